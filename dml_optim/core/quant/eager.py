"""The eager codec: what DirectML runs, every op in place or into the caller's scratch, all native there.

:func:`encode_into` (a value range into codes and scales, working in the values), :func:`compand_` (the one
definition of a closed-form code), :func:`decode_into` (one gather and one multiply), :func:`block_mask` and
:func:`index_elements` (the decoder's scratch).
"""

from __future__ import annotations

import torch

from dml_optim.core.quant.formats import _TINY, StateFormat
from dml_optim.core.quant.tables import _constant, _levels

__all__ = ["block_mask", "index_elements", "encode_into", "compand_", "decode_into"]


def index_elements(fmt: StateFormat, n: int) -> int:
    """The int32 elements :func:`decode_into` needs as its ``index`` scratch for ``n`` values (one per code
    byte: ``n`` at 8 bits, ``n / 2`` at 4)."""
    return n // 2 if fmt.bits == 4 else n




def block_mask(valid: torch.Tensor, block: int) -> torch.Tensor:
    """``(blocks, block)`` bool: which elements of each block hold values (``valid``: per block, the count)."""
    return torch.arange(block, device=valid.device, dtype=valid.dtype).view(1, block) < valid.view(-1, 1)


def encode_into(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, *,
                small: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                work: torch.Tensor | None = None) -> None:
    """Encode ``values`` (whole blocks, float) into ``codes`` and ``scales``, **using ``values`` as the work
    buffer** (it is overwritten): the eager encoder, every op in place or into ``codes``, ``scales`` or
    ``small`` (a float tensor of one element per block, the caller's scratch; allocated if None), so with
    ``small`` given it allocates nothing.

    Ops (8 bits; 4 bits one more, the nibbles' packing): signed ``linalg_vector_norm`` (inf, per block),
    ``add`` (the divisor), ``div_``, then (``root``) ``addcmul``, ``pow_``, ``addcmul`` or (``asinh``) ``asinh_``,
    ``add``, then ``round_``, ``copy_``: 8 or 7; unsigned ``amax``, ``add``, ``div_``, ``pow_``, ``round_``,
    ``copy_``: 6; a ``mask`` (padding: encoded as 0, not counted in the maximum) one ``where`` more.  ``work``
    (a float tensor at least as long as ``values``, the caller's scratch; allocated if None): where the signed
    ``root`` code keeps ``|y|**(-3/4)``.
    """
    if fmt.legacy:
        raise ValueError(f"{fmt.name}: the first codebook's formats are encoded by codec.encode_ (its own encoder)")
    b = fmt.block
    v = values.view(-1, b)
    dtype, device = v.dtype, v.device
    col = scales.view(-1, 1)
    if mask is not None:
        torch.where(mask, v, _constant(0.0, dtype, device), out=v)
    if small is None:
        small = torch.empty(scales.shape, dtype=dtype, device=device)
    s = small.view(-1, 1)
    peak = col if col.dtype == dtype else s  # (float64 values: the maximum in float64, then stored as float32)
    if fmt.signed:
        torch.linalg.vector_norm(v, float("inf"), dim=1, keepdim=True, out=peak)
    else:
        torch.amax(v, dim=1, keepdim=True, out=peak)
    if peak is not col:
        col.copy_(peak)
    torch.add(_constant(_TINY, dtype, device), peak, alpha=1.0 / fmt.divisor, out=s)  # (a zero block: 0 / tiny)
    v.div_(s)
    compand_(v, fmt, work)
    if fmt.bits == 4:
        pairs = v.view(-1, 2)
        low = pairs[:, 0]
        torch.add(low, pairs[:, 1], alpha=16, out=low)
        codes.view(-1, b // 2).copy_(low.view(-1, b // 2))
    else:
        codes.view(-1, b).copy_(v)


def compand_(y: torch.Tensor, fmt: StateFormat, work: torch.Tensor | None = None) -> torch.Tensor:
    """The code of every ``y`` (a value divided by its block's divisor), in place, as a float: the eager
    encoder's ops (``asinh``: ``round(base + gain * asinh(y))``; ``pow``, unsigned ``root``: ``round(y**p)``;
    signed ``root``: ``round(base + y * (y*y + 2**-126)**(-3/8))``, the sign of ``y`` times ``|y|**(1/4)`` in
    three ops, ``work`` holding the power).  For the second codebook this is **the one definition of a code**:
    the compiled kernel's bucket tables (:func:`bucket_tables`) are found from it, so both give the same codes
    bit for bit.  A ``root`` code is ``round(K * |y / absmax|**(1/4))`` (signed: with the sign of ``y``); the
    compiled kernel takes the root as two square roots (:func:`_encode_functional`), a few float32 roundings
    away from this ``pow``: a value within about 1e-5 of a code's rounding edge may take the neighbouring code
    there (tests/test_quant.py measures how rarely)."""
    if fmt.kind == "asinh":
        y.asinh_()
        torch.add(_constant(float(fmt.base), y.dtype, y.device), y, alpha=fmt.gain, out=y)
    elif fmt.kind == "root" and fmt.signed:
        w = work.view(-1)[: y.numel()].view(y.shape) if work is not None else torch.empty_like(y)
        torch.addcmul(_constant(_TINY, y.dtype, y.device), y, y, out=w)
        w.pow_(-0.375)
        torch.addcmul(_constant(float(fmt.base), y.dtype, y.device), y, w, out=y)
    else:
        y.pow_(fmt.param)
    return y.round_()


def decode_into(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, out: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
    """Decode into ``out`` (1-D, whole blocks, float): ``index`` (int32, :func:`index_elements` of them, the
    caller's scratch; allocated if None) receives the codes, one ``index_select`` from the table writes
    ``out``, one multiply scales it: 3 ops, nothing allocated with ``index`` given."""
    n = codes.numel()
    if index is None:
        index = torch.empty(n, dtype=torch.int32, device=codes.device)
    index = index.view(-1)[:n]
    index.copy_(codes.view(-1))
    table = _levels(fmt, out.dtype, codes.device)
    torch.index_select(table, 0, index, out=out.view(n, -1) if fmt.bits == 4 else out.view(-1))
    out.view(-1, fmt.block).mul_(scales.view(-1, 1))
    return out
