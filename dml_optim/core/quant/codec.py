"""Encoding and decoding a state, whichever codec the moment needs: the eager one (DirectML's path), the traced
one (inside a compiled kernel) or the first codebook's."""

from __future__ import annotations

import torch

from dml_optim.core.quant.eager import decode_into, encode_into
from dml_optim.core.quant.formats import _TINY, StateFormat
from dml_optim.core.quant.legacy import _decade_tables, encode_legacy
from dml_optim.core.quant.tables import _constant, _levels, _table
from dml_optim.core.quant.traced import bucket_tables, decode_traced, encode_functional
from dml_optim.core.tracing import is_compiling

__all__ = ["encode_", "decode", "warm_tables"]


def encode_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat,
            mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Encode ``values`` (a float tensor of whole blocks) into ``codes`` (uint8) and ``scales`` (float32).

    ``mask`` (``(blocks, block)`` bool, :func:`block_mask`): elements outside
    it (padding) are encoded as 0 and do not count towards the block's maximum.
    ``values`` is not modified (:func:`encode_into` works in it instead).  A
    block of zeros gets scale 0 (and decodes to zeros); a block holding inf or
    NaN gets a non-finite scale, so it decodes non-finite as a whole, as a
    full-precision state would hold it.

    Inside a compiled kernel it returns the encoder's per-block factor, if any, for the kernel to return:
    inductor computes a value the graph returns once per block, where a value used inside the second loop only
    is computed again at every vector of elements, with a scalar division and square root (about 15% of the 8-bit
    AdamW step at 16M elements on a 2-core CPU); None otherwise.
    """
    b = fmt.block
    if not fmt.legacy:
        if is_compiling():
            k, absmax, factor = encode_functional(values.reshape(-1, b), fmt, mask)
            if fmt.bits == 4:
                k = k[:, 0::2] + k[:, 1::2] * 16
            # (2-D end to end: a compiled kernel indexes it without a modulo; through int32, exact for the whole
            # numbers ``k`` holds: inductor converts float to uint8 with a clamp to int32's range first)
            codes.view(-1, k.shape[1]).copy_(k.to(torch.int32))
            scales.view(-1, 1).copy_(absmax)
            return factor
        work = values.reshape(-1).clone()
        encode_into(work, codes, scales, fmt, mask=mask)
        return None
    encode_legacy(values, codes, scales, fmt, mask)
    return None


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``codes``/``scales`` in ``dtype`` (into ``out`` when given: a 1-D tensor of whole blocks)."""
    per_byte = 2 if fmt.bits == 4 else 1
    if is_compiling():
        return decode_traced(codes, scales, fmt, dtype, out)
    target = out if out is not None else torch.empty(codes.numel() * per_byte, dtype=dtype, device=codes.device)
    decode_into(codes, scales if scales.dtype == dtype else scales.to(dtype), fmt, target)
    if out is None and codes.dim() != 1:
        return target.view(-1, fmt.block)
    return target


def warm_tables(fmt: StateFormat, dtype: torch.dtype, device: torch.device) -> None:
    """Create ``fmt``'s tables for ``dtype`` on ``device`` now (outside a compiled region, which then only reads them)."""
    warm = (fmt.name, dtype, str(device))
    if warm in _WARM:
        return
    if fmt.kind == "de":
        _decade_tables(fmt, dtype, device)
    _table(f"{fmt.name}/levels", fmt.levels(), dtype, device)
    _levels(fmt, dtype, device)
    for value in (_TINY, float(fmt.base), 0.0):
        _constant(value, dtype, device)
    if fmt.kind in ("asinh", "pow") and dtype == torch.float32:
        bucket_tables(fmt, device)
    _WARM.add(warm)


#: ``(format name, dtype, device)`` whose tables :func:`warm_tables` made (the compiled backend warms every
#: call: the check is one set lookup, not the table's values computed again).
_WARM: set[tuple] = set()
