"""Block-wise 8-bit and 4-bit storage of optimizer states (``state_bits=8`` or ``4``).

A quantized state is one more *storage format* of a flat state buffer: the
rule never sees it.  Before the rule runs a range is decoded into the compute
dtype (as a float16 state is converted into float32), after it the result is
encoded back (docs/design.md §5, "Low-bit state").

**Layout.** The elements are cut into blocks of :data:`BLOCK` elements (256
at 8 bits, 128 at 4 bits); each block keeps one float32 scale, its absolute
maximum, and each element one code (a byte, or a nibble: two codes per byte,
element ``2t`` in the low nibble).  Blocks never straddle two parameters: a
quantized flat buffer starts every parameter at a block boundary (zero padding
between parameters), so a parameter's state is its own blocks, and a state
whose values did not change encodes to the very same bits.

**Codes** (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"; Li et al. 2023, "Memory Efficient Optimizers with 4-bit
States"), each value ``v`` normalized by its block's maximum, ``y = v / absmax``:

* ``"de"``, *dynamic exponent* (Dettmers' dynamic tree quantization): a
  magnitude index ``k`` in ``[0, 2**D - 1]`` picks decade ``i = floor(log2 k)``
  and fraction ``j = k - 2**i + 1`` in ``[1, 2**i]``; its level is
  ``10**(i - D + 1) * (0.1 + 0.9 * j / 2**i)``.  The top level of each decade
  is the bottom of the next, so the levels are one monotone grid from
  ``10**(1 - D)`` to exactly 1, denser near 0.  Signed formats (first moment,
  momentum buffer) keep a sign and an exact 0; unsigned ones (second moment,
  Adagrad's sum) exclude 0: index 0 is ``10**-D``, so a second moment never
  decodes to 0 while its first moment does not, which would make the update
  ``m / (sqrt(0) + eps)`` explode (the "zero-point problem" of Li et al.).
  ``D`` = 7 for 8-bit signed, 8 for 8-bit unsigned, 3 for 4-bit signed.
* ``"linear"``, 4-bit unsigned: ``(k + 1) / 16`` for ``k`` in ``[0, 15]``, zero
  excluded (Li et al.'s choice for the second moment at 4 bits, as torchao's).

Encoding is closed-form (the nearest level: within a decade the levels are
evenly spaced, and a decade's top is the next one's bottom; the lowest decade of
a signed format rounds between 0 and its top), and uses only element-wise
ops, one per-block ``amax`` and gathers from 8-entry tables, all native on
DirectML (no ``searchsorted``/``bucketize``, which fall back to the CPU
there).  A decode is one gather from the format's 256- or 16-entry table and
one multiply by the block scale.

Bounds (tests/test_quant.py): the block maximum, 0 (signed formats) and a
block of equal values are exact; a zero block stays zero; otherwise a decoded
value is within half a step of its decade of the original
(``0.45 * 10**(i - D + 1) / 2**i * absmax``; linear: ``absmax / 32``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "BLOCK",
    "MIN_ELEMENTS",
    "StateFormat",
    "format_for",
    "QuantizedState",
    "format_named",
    "warm_tables",
    "encode_",
    "decode",
    "block_mask",
    "tensors_of",
]

#: Elements per block (one float32 scale each).
BLOCK = {8: 256, 4: 128}
#: Parameters with fewer elements keep full-precision state (bitsandbytes' ``min_8bit_size``).
MIN_ELEMENTS = 4096


@dataclass(frozen=True)
class StateFormat:
    """How one state is stored: ``bits`` per code, ``signed``, ``kind`` (``"de"`` or ``"linear"``)."""

    bits: int
    signed: bool
    kind: str

    @property
    def block(self) -> int:
        return BLOCK[self.bits]

    @property
    def name(self) -> str:
        """A stable name, saved in checkpoints (e.g. ``"de8-signed"``)."""
        return f"{self.kind}{self.bits}-{'signed' if self.signed else 'unsigned'}"

    @property
    def decades(self) -> int:
        return self.bits - 1 if self.signed else self.bits

    @property
    def magnitudes(self) -> int:
        """The largest magnitude index ``K`` (codes ``0..K``, signed: ``-K..K``)."""
        return 2 ** self.decades - 1 if self.kind == "de" else 2**self.bits - 1

    @property
    def zero_code(self) -> int:
        """The code of 0 (signed) or of the smallest level (unsigned): what an empty state holds."""
        return 2 ** (self.bits - 1) if self.signed else 0

    def level(self, k: int) -> float:
        """The magnitude of index ``k`` (float64)."""
        if self.kind == "linear":
            return (k + 1) / 2**self.bits
        d = self.decades
        if k == 0:
            return 0.0 if self.signed else 10.0**-d
        i = int(math.floor(math.log2(k)))
        j = k - 2**i + 1
        return 10.0 ** (i - d + 1) * (0.1 + 0.9 * j / 2**i)

    def levels(self) -> list[float]:
        """The decode table: the value of every code ``0 .. 2**bits - 1`` (float64).

        Signed codes are ``2**(bits-1) + sign * k``; the one code no value
        encodes to (``0``) decodes like ``1``, the most negative level.
        """
        n = 2**self.bits
        if not self.signed:
            return [self.level(k) for k in range(n)]
        base = n // 2
        table = [0.0] * n
        for c in range(1, n):
            k = c - base
            table[c] = math.copysign(self.level(abs(k)), k) if k else 0.0
        table[0] = table[1]
        return table


#: (bits, signed) -> format: the first moment and the momentum buffer are signed, the second moment
#: and Adagrad's sum unsigned (their formats exclude 0)
_FORMATS = {
    (8, True): StateFormat(8, True, "de"),
    (8, False): StateFormat(8, False, "de"),
    (4, True): StateFormat(4, True, "de"),
    (4, False): StateFormat(4, False, "linear"),
}


def format_for(bits: int, signed: bool) -> StateFormat:
    """The format of a ``bits``-bit state (``signed`` for the first moment, unsigned for the second)."""
    return _FORMATS[(bits, signed)]


_BY_NAME = {f.name: f for f in _FORMATS.values()}


def format_named(name: str) -> StateFormat:
    """The format whose :attr:`StateFormat.name` is ``name`` (as a checkpoint records it)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown quantized state format {name!r} (known: {', '.join(_BY_NAME)})") from None


# -- per-device constant tables ----------------------------------------------------------------

_TABLES: dict[tuple, torch.Tensor] = {}


def _table(key: str, values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    k = (key, dtype, str(device))
    t = _TABLES.get(k)
    if t is None:
        t = _TABLES[k] = torch.tensor(list(values), dtype=torch.float64).to(dtype=dtype, device=device)
    return t


def warm_tables(fmt: StateFormat, dtype: torch.dtype, device: torch.device) -> None:
    """Create ``fmt``'s tables for ``dtype`` on ``device`` now (outside a compiled region, which then only reads them)."""
    if fmt.kind == "de":
        _decade_tables(fmt, dtype, device)
    _table(f"{fmt.name}/levels", fmt.levels(), dtype, device)


def _decade_tables(fmt: StateFormat, dtype: torch.dtype, device: torch.device):
    """Per decade ``i``: ``10**(D-1-i)`` (the inverse of its top), its bottom as a fraction of its top
    (0.1; 0 for the lowest decade of a format with a zero level: its levels are 0 and its top), fractions
    per unit above the bottom (``2**i / (1 - bottom)``), and ``2**i``."""
    d = fmt.decades
    bottom = [0.0 if i == 0 and fmt.signed else 0.1 for i in range(d)]
    inv_top = _table(f"{fmt.name}/inv_top", [10.0 ** (d - 1 - i) for i in range(d)], dtype, device)
    offset = _table(f"{fmt.name}/bottom", bottom, dtype, device)
    steps = _table(f"{fmt.name}/steps", [2.0**i / (1 - bottom[i]) for i in range(d)], dtype, device)
    pow2 = _table(f"{fmt.name}/pow2", [2.0**i for i in range(d)], dtype, device)
    return inv_top, offset, steps, pow2


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` elementwise: ``index_select`` eagerly (7x faster than advanced indexing on the CPU),
    ``aten::index`` when compiled (the kernel loads the table in place; an ``index_select`` over the
    flattened index makes inductor index the output modulo the row count).  Both are native on DirectML."""
    if _compiling():
        return table[index]
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def _compiling() -> bool:
    check = getattr(torch.compiler, "is_compiling", None)
    return bool(check and check())


# -- encode / decode -----------------------------------------------------------------------------


def block_mask(valid: torch.Tensor, block: int) -> torch.Tensor:
    """``(blocks, block)`` bool: which elements of each block hold values (``valid``: per block, the count)."""
    return torch.arange(block, device=valid.device, dtype=valid.dtype).view(1, block) < valid.view(-1, 1)


def _magnitude_index(a: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The nearest magnitude index (within a decade) of ``a = |y|`` in ``[0, 1]``, as floats."""
    if fmt.kind == "linear":
        n = 2**fmt.bits
        k = torch.round(a * n) - 1
    else:
        d = fmt.decades
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


def encode_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat,
            mask: torch.Tensor | None = None) -> None:
    """Encode ``values`` (a float tensor of whole blocks) into ``codes`` (uint8) and ``scales`` (float32).

    ``mask`` (``(blocks, block)`` bool, :func:`block_mask`): elements outside
    it (padding) are encoded as 0 and do not count towards the block's maximum.
    ``values`` is not modified.  A block of zeros gets scale 0 (and decodes to
    zeros); a block holding inf or NaN gets a non-finite scale, so it decodes
    non-finite as a whole, as a full-precision state would hold it.
    """
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
    codes.view(-1, k.shape[1]).copy_(k)  # (2-D end to end: a compiled kernel indexes it without a modulo)
    scales.view(-1, 1).copy_(absmax)


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``codes``/``scales`` in ``dtype`` (into ``out`` when given: a 1-D tensor of whole blocks)."""
    per_byte = 2 if fmt.bits == 4 else 1
    index = codes.view(-1, fmt.block // per_byte).to(torch.int32)
    if fmt.bits == 4:
        high = torch.div(index, 16, rounding_mode="floor")
        index = torch.stack((index - high * 16, high), dim=-1).view(-1, fmt.block)
    table = _table(f"{fmt.name}/levels", fmt.levels(), dtype, codes.device)
    values = _gather(table, index) * scales.view(-1, 1).to(dtype)
    if out is None:  # 1-D codes give 1-D values; codes shaped (blocks, ...) give (blocks, block)
        return values.view(-1) if codes.dim() == 1 else values
    out.view(-1, fmt.block).copy_(values)
    return out


# -- the storage object --------------------------------------------------------------------------


def tensors_of(state) -> list[torch.Tensor]:
    """The tensors a state is stored in: itself, or a quantized state's codes and scales."""
    return state.tensors() if isinstance(state, QuantizedState) else [state]


class QuantizedState:
    """A flat state stored block-quantized: ``codes`` (uint8) and one float32 ``scales`` entry per block.

    ``numel`` elements (a whole number of blocks); slicing by element range
    (block-aligned) gives a view of the same storage.
    """

    __slots__ = ("codes", "scales", "format")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat):
        self.codes, self.scales, self.format = codes, scales, fmt

    @classmethod
    def full(cls, numel: int, value: float, fmt: StateFormat, device) -> "QuantizedState":
        """``numel`` elements equal to ``value`` (exact: the block maximum is exact), allocated on ``device``."""
        blocks = numel // fmt.block
        if blocks * fmt.block != numel:
            raise ValueError(f"a quantized state holds whole blocks of {fmt.block} elements, got {numel}")
        base = 2 ** (fmt.bits - 1) if fmt.signed else 0
        if value == 0:
            code, scale = fmt.zero_code, 0.0
        elif value > 0:
            code, scale = base + fmt.magnitudes, float(value)  # the top level, 1, times the value
        elif fmt.signed:
            code, scale = base - fmt.magnitudes, -float(value)
        else:
            raise ValueError(f"an unsigned state cannot hold {value!r}")
        if fmt.bits == 4:
            code = code + 16 * code
        per_byte = 2 if fmt.bits == 4 else 1
        codes = torch.full((numel // per_byte,), code, dtype=torch.uint8, device=device)
        scales = torch.full((blocks,), scale, dtype=torch.float32, device=device)
        return cls(codes, scales, fmt)

    @property
    def numel(self) -> int:
        return self.scales.numel() * self.format.block

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]

    def _check(self, a: int, b: int) -> None:
        block = self.format.block
        if a % block or (b % block and b != self.numel):
            raise ValueError(f"a quantized state is sliced at block boundaries ({block}), got [{a}, {b})")

    def __getitem__(self, index: slice) -> "QuantizedState":
        a, b, _ = index.indices(self.numel)
        self._check(a, b)
        per_byte = 2 if self.format.bits == 4 else 1
        block = self.format.block
        return QuantizedState(self.codes[a // per_byte : b // per_byte], self.scales[a // block : b // block],
                              self.format)

    def decode(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(self.codes, self.scales, self.format, dtype, out)

    def encode_(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        encode_(values, self.codes, self.scales, self.format, mask)

    def copy_(self, other: "QuantizedState") -> "QuantizedState":
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)
        return self

    def clone(self) -> "QuantizedState":
        return QuantizedState(self.codes.clone(), self.scales.clone(), self.format)

    def to(self, device) -> "QuantizedState":
        return QuantizedState(self.codes.to(device), self.scales.to(device), self.format)

    def __repr__(self) -> str:
        return f"QuantizedState({self.format.name}, {self.numel} elements, {self.nbytes} bytes, {self.device})"
