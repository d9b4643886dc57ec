"""Per-device constant tables of the quantized formats: decode tables, constants, the warm-up a compiled kernel
needs before it runs (it only reads them), and the one gather both the eager and the traced codecs use."""

from __future__ import annotations

import torch

from dml_optim.core.quant.formats import _TINY, StateFormat
from dml_optim.core.tracing import is_compiling

__all__: list[str] = []


_TABLES: dict[tuple, torch.Tensor] = {}


def _table(key: str, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    k = (key, dtype, str(device))
    t = _TABLES.get(k)
    if t is None:
        t = _TABLES[k] = torch.tensor(values, dtype=torch.float64).to(dtype=dtype, device=device)
    return t


def _levels(fmt: StateFormat, dtype: torch.dtype, device) -> torch.Tensor:
    """The decode table: one value per code (8 bits), or per byte the pair of values of its two nibbles
    (4 bits: ``(256, 2)``, low nibble first), so a decode of packed codes is one gather."""
    if fmt.bits == 4:
        t = fmt.levels()
        return _table(f"{fmt.name}/pairs", [[t[c % 16], t[c // 16]] for c in range(256)], dtype, device)
    return _table(f"{fmt.name}/levels", fmt.levels(), dtype, device)


def _constant(value: float, dtype: torch.dtype, device) -> torch.Tensor:
    """A 0-d tensor on ``device`` (an operand of an ``out=`` op that has no Scalar overload)."""
    return _table(f"const/{value!r}", value, dtype, device)



def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` elementwise: ``index_select`` eagerly (7x faster than advanced indexing on the CPU),
    an ``embedding`` when compiled (the kernel loads the table in place; an ``index_select`` over the
    flattened index makes inductor index the output modulo the row count, and ``aten::index`` wraps negative
    indices per element: the embedding's lowering does neither).  Both are native on DirectML."""
    if is_compiling():
        if table.dim() == 1:
            return torch.nn.functional.embedding(index, table.view(-1, 1)).view(index.shape)
        return torch.nn.functional.embedding(index, table)
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])
