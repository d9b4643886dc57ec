"""The codec a compiled kernel traces (``torch.compile``: the CPU and CUDA; never DirectML): out of place, one
fused loop.  The ``asinh``/``pow`` encoder is a lookup on the float's bits (:func:`bucket_tables`, found from the
eager encoder so both give the same codes); the ``root`` codes are two square roots and four multiplies
(:func:`root_levels`)."""

from __future__ import annotations

import torch

from dml_optim.core.quant.eager import compand_
from dml_optim.core.quant.formats import _INVERSE_DIVISOR, _ROOT_STEP, _TINY, StateFormat
from dml_optim.core.quant.tables import _gather, _levels

__all__ = ["bucket_tables", "encode_buckets", "encode_functional", "root_levels", "decode_traced"]


#: Bucket tables per (format, device): ``(shift, first, edge, step)`` (:func:`bucket_tables`).
_BUCKETS: dict[tuple, tuple] = {}


def _codes_of_bits(bits: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """:func:`compand_` of the float32 values whose bit patterns are ``bits`` (int32), in whole blocks."""
    n = bits.numel()
    padded = torch.zeros(-(-n // 256) * 256, dtype=torch.int32, device=bits.device)
    padded[:n] = bits
    return compand_(padded.view(torch.float32).clone(), fmt)[:n]


def bucket_tables(fmt: StateFormat, device) -> tuple[int, torch.Tensor]:
    """The compiled encoder's lookup ``(shift, entry)``: float32 ``y`` falls in bucket ``bits(y) >> shift``
    (its sign, exponent and top mantissa bits); a bucket's int32 entry holds the code of its smallest
    magnitude (bits 0-7), the change of code at its edge plus one (bits 8-9: 0, 1 or 2; at most one change
    per bucket) and the edge, the low ``shift`` bits of the first magnitude that takes the changed code
    (bits 10 up).  Found from :func:`compand_` run on ``device`` (the eager encoder's own ops, there): each
    bucket's ends, then a bisection over the bit patterns of the buckets whose ends differ.  The mantissa
    bits are the fewest that leave no bucket with two changes (a code's levels are at least 1.6% apart:
    4 bits for the 8-bit asinh code, 7 for the 8-bit power code).  A bucket beyond twice the divisor (a
    block's values give ``|y| <= divisor``; inf, NaN) gets no edge, and its code clamped to ``[0, 255]``."""
    device = torch.device(device)
    key = (fmt.name, str(device))
    got = _BUCKETS.get(key)
    if got is not None:
        return got
    for m in range(2, 12):
        shift = 23 - m
        n = 1 << (32 - shift)
        b = torch.arange(n, dtype=torch.int64, device=device)
        lo = ((b << shift) & 0xFFFFFFFF).to(torch.int64)
        lo = torch.where(lo >= 1 << 31, lo - (1 << 32), lo).to(torch.int32)  # the smallest magnitude (wrapped)
        hi = lo | ((1 << shift) - 1)  # the largest
        first, last = _codes_of_bits(lo, fmt), _codes_of_bits(hi, fmt)
        finite = (lo & 0x7FFFFFFF).view(torch.float32) <= 2 * fmt.divisor  # (|y| <= divisor: the rest never occurs)
        if not fmt.signed:
            finite &= lo >= 0  # (an unsigned state's y is >= 0: -0.0 at most)
        step = torch.where(finite, last - first, torch.zeros((), device=device))
        if bool((step.abs() > 1).any()):
            continue
        change = step != 0
        low, high = lo.clone(), hi.clone()  # per bucket: code(low) == first, code(high) != first
        for _ in range(shift):
            mid = low + ((high - low) >> 1)
            same = _codes_of_bits(mid, fmt) == first
            low = torch.where(same, mid, low)
            high = torch.where(same, high, mid)
        # one int32 per bucket: its first code (8 bits; a bucket beyond the range or NaN: its code clamped),
        # step + 1 (2 bits), the low ``shift`` bits of its edge (0 where it has none: step 0 then)
        code = torch.nan_to_num(first, nan=0.0).clamp(0, 255).to(torch.int32)
        low = torch.where(change, high & ((1 << shift) - 1), torch.zeros((), dtype=torch.int32, device=device))
        entry = code | ((step.to(torch.int32) + 1) << 8) | (low << 10)
        got = _BUCKETS[key] = (shift, entry)
        return got
    raise ValueError(f"{fmt.name}: no bucket width with at most one code change per bucket")  # pragma: no cover


def encode_buckets(y: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The codes of float32 ``y`` (as floats) by :func:`bucket_tables`: a shift, a compare and one gather
    from a small table per element, no transcendental function; equal to :func:`compand_` bit for bit
    wherever ``|y| <= 1.01 * divisor`` (a block's values give ``|y| <= divisor``, to rounding; beyond, a code
    over 255 is clamped), tests/test_quant.py checks every edge and its neighbours."""
    shift, entry = bucket_tables(fmt, y.device)
    bits = y.view(torch.int32)
    e = _gather(entry, (bits >> shift) & ((1 << (32 - shift)) - 1))
    below = (bits & ((1 << shift) - 1)) < (e >> 10)
    return torch.where(below, e & 255, (e & 255) + ((e >> 8) & 3) - 1).to(y.dtype)


def encode_functional(v: torch.Tensor, fmt: StateFormat, mask: torch.Tensor | None):
    """``(codes as float indices, absmax, per-block factor or None)`` of ``v`` (``(blocks, block)``), out of
    place: the compiled kernel's encoder (one fused loop; float32: the bucket lookup of :func:`encode_buckets`).
    The factor (``root`` codes on the CPU: one float per block that every element of the block multiplies by)
    is for the kernel to return (:func:`encode_`)."""
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    if mask is not None:
        v = torch.where(mask, v, zero)
    a = v.abs() if fmt.signed else v
    absmax = torch.amax(a, dim=1, keepdim=True)
    divisor = absmax * _INVERSE_DIVISOR[fmt.name] + _TINY
    if fmt.kind == "root":
        # square roots (vector instructions; no table, no transcendental function) and one reciprocal per block,
        # not a division per element; unsigned, ``sqrt(v)`` is the rule's own (AdamW's denominator): one
        # square root more, ``sqrt(sqrt(v) * sqrt(1 / divisor))``
        factor = torch.reciprocal(divisor) if fmt.signed else torch.sqrt(torch.reciprocal(divisor))
        kept = factor if v.device.type == "cpu" else None
        if fmt.signed:
            r = torch.sqrt(torch.sqrt(a * factor))  # (the sign by a compare and a select: inductor calls Sleef's
            # copysign per vector, 0.5 ms of the 8-bit step at 16M elements on the CPU; -0.0 gives code `base` either way)
            return torch.round(torch.where(v < 0, -r, r)) + fmt.base, absmax, kept
        return torch.round(torch.sqrt(torch.sqrt(v) * factor)), absmax, kept
    y = v / divisor
    if y.dtype == torch.float32:
        return encode_buckets(y, fmt), absmax, None
    if fmt.kind == "asinh":
        k = torch.asinh(y) * fmt.gain + fmt.base
    else:
        k = torch.pow(y, fmt.param)
    return torch.round(k), absmax, None


def root_levels(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The float32 levels of a ``root`` format's ``codes`` (any integer dtype) by arithmetic, equal to its table bit
    for bit (:meth:`StateFormat.level` is this evaluation): ``t = max(k, 0.5) * float32(1 / K)`` (signed: ``k``
    of either sign, code 0 as 1), then ``(t * t) * (t * t)``, the sign as ``t * |t|`` (its magnitude is
    ``t * t``'s): multiplies only, so no fused multiply-add can change a rounding.  What the compiled kernel
    decodes with (a gather from the table is a scalar load per element there).  The signed clamp is taken on
    int32 and the unsigned ``max`` is a select: inductor's float ``maximum`` propagates NaN (four vector
    instructions where these take one or two; 3% of the 8-bit AdamW step on the CPU)."""
    c = _ROOT_STEP[(fmt.bits, fmt.signed)]
    if fmt.signed:
        t = torch.clamp_min(codes.to(torch.int32) - fmt.base, -fmt.magnitudes).to(torch.float32) * c
        return (t * t) * (t * t.abs())
    k = codes.to(torch.float32)
    t = torch.where(k == 0, 0.5, k) * c
    t = t * t
    return t * t


def decode_traced(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~dml_optim.core.quant.codec.decode` inside a compiled kernel: a ``root`` format decoded by
    arithmetic (no gather), the others gathered from the table as an embedding."""
    per_byte = 2 if fmt.bits == 4 else 1
    codes2d = codes.view(-1, fmt.block // per_byte)
    if fmt.kind == "root" and dtype == torch.float32:
        values = root_levels(codes2d, fmt)  # (the bytes converted once, straight to float32)
    else:
        index = codes2d.to(torch.int32)
        table = _levels(fmt, dtype, codes.device)
        values = (_gather(table, index).view(-1, fmt.block) if fmt.bits == 4 else _gather(table, index))
    values = values * scales.view(-1, 1).to(dtype)
    if out is None:
        return values.view(-1) if codes.dim() == 1 else values
    out.view(-1, fmt.block).copy_(values)
    return out
