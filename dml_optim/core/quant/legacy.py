"""The first codebook (``dml-optim-blockwise-1``: Dettmers et al.'s dynamic exponent, and linear 4-bit codes):
its encoder, kept so that its checkpoints load and convert."""

from __future__ import annotations

import torch

from dml_optim.core.quant.formats import StateFormat
from dml_optim.core.quant.tables import _gather, _table

__all__ = ["encode_legacy"]



def _decade_tables(fmt: StateFormat, dtype: torch.dtype, device: torch.device):
    """Per decade ``i``: ``10**(D-1-i)`` (the inverse of its top), its bottom as a fraction of its top
    (0.1; 0 for the lowest decade of a format with a zero level: its levels are 0 and its top), fractions
    per unit above the bottom (``2**i / (1 - bottom)``), and ``2**i``."""
    d = fmt.de_decades
    bottom = [0.0 if i == 0 and fmt.signed else 0.1 for i in range(d)]
    inv_top = _table(f"{fmt.name}/inv_top", [10.0 ** (d - 1 - i) for i in range(d)], dtype, device)
    offset = _table(f"{fmt.name}/bottom", bottom, dtype, device)
    steps = _table(f"{fmt.name}/steps", [2.0**i / (1 - bottom[i]) for i in range(d)], dtype, device)
    pow2 = _table(f"{fmt.name}/pow2", [2.0**i for i in range(d)], dtype, device)
    return inv_top, offset, steps, pow2


def _magnitude_index(a: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The nearest magnitude index (within a decade) of ``a = |y|`` in ``[0, 1]``, as floats (first codebook)."""
    if fmt.kind == "linear":
        n = 2**fmt.bits
        k = torch.round(a * n) - 1
    else:
        d = fmt.de_decades
        i = torch.floor(torch.log10(a)) + d
        i = torch.minimum(torch.where(i >= 0, i, torch.zeros((), dtype=a.dtype, device=a.device)),
                          torch.full((), d - 1, dtype=a.dtype, device=a.device))  # (log10(0) = -inf, NaN -> 0)
        index = i.to(torch.int32)
        inv_top, bottom, steps, pow2 = _decade_tables(fmt, a.dtype, a.device)
        top = _gather(pow2, index)
        j = torch.round((a * _gather(inv_top, index) - _gather(bottom, index)) * _gather(steps, index))
        j = torch.minimum(torch.where(j >= 0, j, torch.zeros((), dtype=a.dtype, device=a.device)), top)
        k = top - 1 + j  # j = 0 is the top of the decade below (the same level)
    k = torch.minimum(k, torch.full((), fmt.magnitudes, dtype=a.dtype, device=a.device))
    return torch.where(k >= 0, k, torch.zeros((), dtype=a.dtype, device=a.device))  # (and NaN -> 0)


def encode_legacy(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat,
                  mask: torch.Tensor | None = None) -> None:
    """The first codebook's encoder (``de`` and ``linear`` formats), out of place: a ``log10`` per element and
    gathers from 8-entry tables (kept for tests and for conversions of its checkpoints)."""
    b = fmt.block
    v = values.reshape(-1, b)
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=v.dtype, device=v.device))
    a = torch.abs(v)
    absmax = torch.amax(a, dim=1, keepdim=True)
    safe = torch.where(absmax > 0, absmax, torch.ones((), dtype=absmax.dtype, device=absmax.device))
    k = _magnitude_index(a / safe, fmt)
    if fmt.signed:
        k = k * torch.sign(v) + 2 ** (fmt.bits - 1)
    if fmt.bits == 4:
        k = k[:, 0::2] + k[:, 1::2] * 16
    codes.view(-1, k.shape[1]).copy_(k)
    scales.view(-1, 1).copy_(absmax)
