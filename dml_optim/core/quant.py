"""Block-wise 8-bit and 4-bit storage of optimizer states (``state_bits=8`` or ``4``).

A quantized state is one more *storage format* of a flat state buffer: the
rule never sees it.  Before the rule runs a range is decoded into the compute
dtype (as a float16 state is converted into float32), after it the result is
encoded back (docs/design.md §5, "Low-bit state").

Long by design: it holds three codebooks (the first two still decode the checkpoints saved with them), each
with its eager encoder and decoder (in place, in a caller's scratch) and the form a compiled kernel traces.

**Layout.** The elements are cut into blocks of :data:`BLOCK` elements (256
at 8 bits, 128 at 4 bits); each block keeps one float32 scale, its absolute
maximum, and each element one code (a byte, or a nibble: two codes per byte,
element ``2t`` in the low nibble).  Blocks never straddle two parameters: a
quantized flat buffer starts every parameter at a block boundary (zero padding
between parameters), so a parameter's state is its own blocks, and a state
whose values did not change encodes to the very same bits.

**Codes** of the codebook :data:`CODEBOOK` (what new states use, :data:`ACTIVE_CODEBOOK`; a
value ``v`` normalized by its block's maximum, ``y = v / absmax``, ``K`` the
largest magnitude index: 127 or 7 signed, 255 or 15 unsigned):

* ``"root"``, every 8-bit state: the index ``k = round(K * |y|**(1/4))`` (signed
  states, the first moment and the momentum buffer, keep the sign of ``y`` and
  store ``128 + k``); level ``(k / K)**4`` *as float32 evaluates it*,
  ``((max(k, 1/2) * float32(1 / K))**2)**2`` (index 0 of an unsigned state at
  ``k = 1/2``, as ``"pow"`` below), so that a compiled kernel decodes by four
  multiplies, the table bit for bit (:func:`root_levels`), and encodes by two
  square roots: no gather, no transcendental function.
* ``"asinh"``, 4-bit signed states (first moment, momentum buffer): the index
  ``k = round(K * asinh(S * y) / asinh(S))`` (``asinh`` is odd: no sign
  to split off), stored as ``2**(bits-1) + k``; level ``sinh(asinh(S) * k / K) / S``.
  Linear near 0 (exact 0) and logarithmic from ``1/S`` up (a constant
  relative step ``asinh(S) / K``): mu-law companding.  ``S`` = 5.
* ``"pow"``, 4-bit unsigned states (second moment, Adagrad's sum): the index
  ``k = round(K * y**p)``, level ``(k / K)**(1/p)`` (``p`` = 1/2); index 0 is ``(0.5 / K)**(1/p)``, the top of the values that
  round to it, not 0: a second moment never decodes to 0 while its first moment
  does not (the "zero-point problem" of Li et al. 2023, "Memory Efficient
  Optimizers with 4-bit States").

Each is one closed-form expression per element, no decade search: the eager
encoder is 6 (unsigned), 7 (``asinh``) or 8 (signed ``root``) ops per block range, each in place or
into an ``out=`` tensor the caller keeps, all native on DirectML.  The compiled ``asinh`` and ``pow``
encoders (float32) are a lookup on the float's bits, a shift, one gather from a small table and a compare,
whose table is found from the eager encoder (:func:`bucket_tables`): the same codes bit for bit; the
compiled ``root`` encoder's square roots and the eager ``pow`` may round a value within about 1e-5 of a
code's edge to neighbouring codes.  An eager decode is one gather from the format's 256- or 16-entry
table (4 bits: a 256 x 2 table of byte -> two values, no unpacking ops) and one multiply by the block scale.

The second codebook, ``"dml-optim-blockwise-2"`` (:data:`SECOND_CODEBOOK`), had the 4-bit codes above and
at 8 bits ``"asinh"`` (``S`` = 1e4) and ``"pow"`` (``p`` = 1/4, levels in float64); its checkpoints load.

The first codebook, ``"dml-optim-blockwise-1"`` (:data:`LEGACY_CODEBOOK`), is
kept for reading checkpoints: ``"de"`` (Dettmers et al. 2022's dynamic
exponent: a magnitude index ``k`` in ``[0, 2**D - 1]`` picks decade
``i = floor(log2 k)`` and fraction ``j = k - 2**i + 1``, level
``10**(i - D + 1) * (0.1 + 0.9 * j / 2**i)``; signed ones keep an exact 0,
unsigned ones have ``10**-D`` at index 0) and ``"linear"`` (4-bit unsigned,
``(k + 1) / 16``).  Its encoder (a ``log10`` per element and gathers from
8-entry tables) stays for tests and conversions.

Bounds (tests/test_quant.py): the block maximum, 0 (signed formats) and a
block of equal values are exact; a zero block stays zero; otherwise a value is
rounded to the nearest level *in the companded domain* (``asinh(S y)`` or
``|y|**p``): within half a companded step (:meth:`StateFormat.bound`).
Blocks whose maximum is below ``2**-126 * c`` (``c`` the format's
:attr:`StateFormat.divisor`: about 3e4 signed, 4e9 for the 8-bit second
moment, i.e. a block maximum under 5e-29) are encoded against a larger
divisor: their values decode smaller, never larger than the maximum.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from dml_optim.core.tracing import is_compiling

__all__ = [
    "BLOCK",
    "MIN_ELEMENTS",
    "CODEBOOK",
    "SECOND_CODEBOOK",
    "LEGACY_CODEBOOK",
    "ACTIVE_CODEBOOK",
    "CODEBOOKS",
    "StateFormat",
    "format_for",
    "QuantizedState",
    "format_named",
    "warm_tables",
    "encode_",
    "encode_into",
    "compand_",
    "bucket_tables",
    "encode_buckets",
    "decode",
    "decode_into",
    "block_mask",
    "tensors_of",
    "index_elements",
    "chunk_elements",
]

#: Elements per block (one float32 scale each).
BLOCK = {8: 256, 4: 128}
#: Parameters with fewer elements keep full-precision state (bitsandbytes' ``min_8bit_size``).
MIN_ELEMENTS = 4096
#: The smallest normal float32: what a block divisor is at least (a zero block divides 0 by it: codes of 0).
_TINY = 2.0**-126


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (a product of two float32 values is exact in float64, so this
    rounding of it is float32's multiply)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class StateFormat:
    """How one state is stored: ``bits`` per code, ``signed``, ``kind`` (``"root"``, ``"asinh"``, ``"pow"``; the
    first codebook's ``"de"``, ``"linear"``) and its ``param`` (``asinh``: ``S``; ``pow``: the exponent ``p``;
    ``root``: 1/4, the only root :meth:`level` and :func:`root_levels` evaluate)."""

    bits: int
    signed: bool
    kind: str
    param: float = 0.0

    @property
    def block(self) -> int:
        return BLOCK[self.bits]

    @property
    def name(self) -> str:
        """A stable name (e.g. ``"asinh8-signed"``), also the compiled kernel's key."""
        return f"{self.kind}{self.bits}-{'signed' if self.signed else 'unsigned'}"

    @property
    def legacy(self) -> bool:
        """A format of the first codebook (read from checkpoints, converted on load)."""
        return self.kind in ("de", "linear")

    @property
    def magnitudes(self) -> int:
        """The largest magnitude index ``K`` (codes ``0..K``, signed: ``base - K .. base + K``)."""
        if self.kind == "de":
            return 2 ** self.de_decades - 1
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def base(self) -> int:
        """The code of index 0: ``2**(bits-1)`` signed, 0 unsigned."""
        return 2 ** (self.bits - 1) if self.signed else 0

    @property
    def zero_code(self) -> int:
        """The code of 0 (signed) or of the smallest level (unsigned): what an empty state holds."""
        return self.base

    @property
    def de_decades(self) -> int:
        """``D`` of a dynamic-exponent format of the first codebook."""
        return self.bits - 1 if self.signed else self.bits

    @property
    def decades(self) -> int:
        """How many decades below the block maximum the smallest nonzero level lies (rounded)."""
        if self.kind == "de":
            return self.de_decades
        smallest = self.level(1) if self.signed else self.level(0)
        return int(round(-math.log10(smallest)))

    @property
    def divisor(self) -> float:
        """What the block maximum is divided by before the companding function: ``y * divisor`` is its argument
        (``asinh``: ``S``; ``pow``: ``K**(1/p)``, so that ``(y * divisor)**p = K * y**p``)."""
        if self.kind == "asinh":
            return self.param
        if self.kind in ("pow", "root"):
            return float(self.magnitudes) ** (1.0 / self.param)
        raise ValueError(f"{self.name} has no closed-form encoder")

    @property
    def gain(self) -> float:
        """What the companded value is multiplied by to give the index (``asinh``: ``K / asinh(S)``; ``pow``: 1)."""
        return self.magnitudes / math.asinh(self.param) if self.kind == "asinh" else 1.0

    def level(self, k: int) -> float:
        """The magnitude of index ``k`` (float64)."""
        K = self.magnitudes
        if self.kind == "asinh":
            return 1.0 if k == K else math.sinh(math.asinh(self.param) * k / K) / self.param
        if self.kind == "pow":
            return (max(k, 0.5) / K) ** (1.0 / self.param) if k < K else 1.0
        if self.kind == "root":  # (k / K)**4 as float32 evaluates it: what the compiled decoder computes
            t = _f32(_f32(max(k, 0.5)) * _f32(1.0 / K))
            t = _f32(t * t)
            return _f32(t * t)  # (k = K: exactly 1, as float32(1 / K) * K rounds to 1 for K = 127 and 255)
        if self.kind == "linear":
            return (k + 1) / 2**self.bits
        d = self.de_decades
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

    def bound(self, y: float) -> float:
        """The largest error of a decoded value whose block-normalized original is ``y`` (``|y| <= 1``):
        half a step of the companded domain around ``|y|`` (and, below the smallest level of an unsigned
        format, the distance up to it)."""
        a = abs(y)
        K = self.magnitudes
        if self.kind == "asinh":
            A, S = math.asinh(self.param), self.param
            u = math.asinh(S * a) * K / A
            lo, hi = max(u - 0.5, 0.0), min(u + 0.5, K)
            return max(a - math.sinh(A * lo / K) / S, math.sinh(A * hi / K) / S - a)
        if self.kind in ("pow", "root"):
            p = self.param
            u = K * a**p
            if u < 0.5:
                return self.level(0) - a
            lo, hi = u - 0.5, min(u + 0.5, K)
            return max(a - (lo / K) ** (1 / p), (hi / K) ** (1 / p) - a)
        if self.kind == "linear":  # half a step of 1/16; below the smallest level (1/16) the distance up to it
            return 1 / 16 - a if a < 1 / 16 else 1 / 32
        d = self.de_decades  # half a step of the decade; below the smallest level the distance to it
        i = min(max(math.floor(math.log10(a)) + d, 0), d - 1) if a > 0 else 0
        return max(0.45 * 10.0 ** (i - d + 1) / 2**i, 0.55 * 10.0 ** (1 - d) if self.signed else 10.0**-d)


#: The codebook :func:`format_for` gives (its name is saved in checkpoints, ``state_dict()["dml_optim"]``).
CODEBOOK = "dml-optim-blockwise-3"
#: The second codebook (``asinh`` signed states, ``pow`` unsigned ones at 8 bits): checkpoints saved with it load.
SECOND_CODEBOOK = "dml-optim-blockwise-2"
#: The first codebook (dynamic exponent and linear codes): checkpoints saved with it still load.
LEGACY_CODEBOOK = "dml-optim-blockwise-1"

_ASINH4, _POW4 = StateFormat(4, True, "asinh", 5.0), StateFormat(4, False, "pow", 0.5)  # (in both closed-form books)

#: codebook -> (bits, signed) -> format.  The first moment and the momentum buffer are signed, the second
#: moment and Adagrad's sum unsigned (their formats have no 0 level).
CODEBOOKS: dict[str, dict[tuple[int, bool], StateFormat]] = {
    CODEBOOK: {
        (8, True): StateFormat(8, True, "root", 0.25),
        (8, False): StateFormat(8, False, "root", 0.25),
        (4, True): _ASINH4,
        (4, False): _POW4,
    },
    SECOND_CODEBOOK: {
        (8, True): StateFormat(8, True, "asinh", 1e4),
        (8, False): StateFormat(8, False, "pow", 0.25),
        (4, True): _ASINH4,
        (4, False): _POW4,
    },
    LEGACY_CODEBOOK: {
        (8, True): StateFormat(8, True, "de"),
        (8, False): StateFormat(8, False, "de"),
        (4, True): StateFormat(4, True, "de"),
        (4, False): StateFormat(4, False, "linear"),
    },
}


#: The codebook new states are created in (:func:`format_for`'s default), and the name a checkpoint of them
#: carries (``state_dict()["dml_optim"]["quantization"]``); a checkpoint of the first codebook is read with
#: its own formats and encoded again in this one.
ACTIVE_CODEBOOK = CODEBOOK


def format_for(bits: int, signed: bool, codebook: str | None = None) -> StateFormat:
    """The format of a ``bits``-bit state (``signed`` for the first moment, unsigned for the second) in
    ``codebook`` (default :data:`ACTIVE_CODEBOOK`; a checkpoint names its own)."""
    codebook = ACTIVE_CODEBOOK if codebook is None else codebook
    try:
        return CODEBOOKS[codebook][(bits, signed)]
    except KeyError:
        raise ValueError(f"unknown quantized state codebook {codebook!r} (known: {', '.join(CODEBOOKS)})"
                         if codebook not in CODEBOOKS else f"no {bits}-bit format in {codebook!r}") from None


_BY_NAME = {f.name: f for book in CODEBOOKS.values() for f in book.values()}
#: ``1 / divisor`` of each closed-form format, computed once (a compiled kernel reads a constant; computed from
#: the format's fields while dynamo traces, ``K ** (1 / p)`` became a ``pow`` per element).
_INVERSE_DIVISOR = {f.name: 1.0 / f.divisor for f in _BY_NAME.values() if not f.legacy}
#: ``float32(1 / K)`` of each ``root`` format by ``(bits, signed)`` (:func:`root_levels`; computed once, outside any
#: trace; not keyed by :attr:`StateFormat.name`: torch 2.4's dynamo misreads that f-string on a captured format).
_ROOT_STEP = {(f.bits, f.signed): _f32(1.0 / f.magnitudes) for f in _BY_NAME.values() if f.kind == "root"}


def format_named(name: str) -> StateFormat:
    """The format whose :attr:`StateFormat.name` is ``name`` (as a compiled kernel's key records it)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown quantized state format {name!r} (known: {', '.join(_BY_NAME)})") from None


# -- per-device constant tables ----------------------------------------------------------------

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


# -- sizes: scratch and chunks -------------------------------------------------------------------


def index_elements(fmt: StateFormat, n: int) -> int:
    """The int32 elements :func:`decode_into` needs as its ``index`` scratch for ``n`` values (one per code
    byte: ``n`` at 8 bits, ``n / 2`` at 4)."""
    return n // 2 if fmt.bits == 4 else n


def chunk_elements(numel: int, bytes_per_element: int, *, ops_per_chunk: int, max_scratch: int | None = None,
                   min_scratch: int = 32 << 20, scratch_per_param: float = 0.5, max_ops: int | None = None,
                   align: int = 256) -> int:
    """How many elements one chunk of an eager step over a buffer of ``numel`` elements takes.

    The step keeps ``bytes_per_element`` bytes of scratch per chunk element (decoded states, the rule's
    scratch, the decode index).  The scratch may be ``max(min_scratch, scratch_per_param * numel)`` bytes
    (32 MiB or 0.5 bytes per parameter, whichever is larger; ``max_scratch`` overrides), which gives the
    largest chunk; the chunks are then made equal (a buffer of 2.5 chunks runs as 3 of 5/6 each, not 2 and a
    half, with no larger scratch), rounded up to ``align`` (whole blocks).  ``ops_per_chunk`` and ``max_ops``
    (optional): raise ValueError if the step would dispatch more than ``max_ops`` ops.
    """
    if numel <= 0:
        return 0
    budget = max_scratch if max_scratch is not None else max(min_scratch, int(scratch_per_param * numel))
    largest = max(align, budget // max(1, bytes_per_element) // align * align)
    chunks = -(-numel // largest)
    size = -(-numel // chunks)
    size = -(-size // align) * align
    if max_ops is not None and chunks * ops_per_chunk > max_ops:
        raise ValueError(f"{numel} elements in chunks of {size} take {chunks * ops_per_chunk} ops, over {max_ops}")
    return min(size, -(-numel // align) * align)


# -- encode / decode -----------------------------------------------------------------------------


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
        encode_(values, codes, scales, fmt, mask)
        return
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


def _encode_functional(v: torch.Tensor, fmt: StateFormat, mask: torch.Tensor | None):
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
            k, absmax, factor = _encode_functional(values.reshape(-1, b), fmt, mask)
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


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat, dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``codes``/``scales`` in ``dtype`` (into ``out`` when given: a 1-D tensor of whole blocks)."""
    per_byte = 2 if fmt.bits == 4 else 1
    if is_compiling():
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
    target = out if out is not None else torch.empty(codes.numel() * per_byte, dtype=dtype, device=codes.device)
    decode_into(codes, scales if scales.dtype == dtype else scales.to(dtype), fmt, target)
    if out is None and codes.dim() != 1:
        return target.view(-1, fmt.block)
    return target


# -- the first codebook's encoder (dynamic exponent, linear) ------------------------------------------


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
        base = fmt.base
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

    def decode(self, dtype: torch.dtype, out: torch.Tensor | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
        """The values in ``dtype`` (into ``out``; with ``index``, an int32 scratch of :func:`index_elements`,
        nothing is allocated)."""
        if index is not None and out is not None and not is_compiling() and self.scales.dtype == dtype:
            return decode_into(self.codes, self.scales, self.format, out, index)
        return decode(self.codes, self.scales, self.format, dtype, out)

    def encode_(self, values: torch.Tensor, mask: torch.Tensor | None = None, *,
                small: torch.Tensor | None = None, work: torch.Tensor | None = None,
                overwrite: bool = False) -> torch.Tensor | None:
        """Encode ``values``; with ``overwrite`` the encoder works in ``values`` (:func:`encode_into`, with
        ``small`` and ``work`` its scratch: nothing allocated), else ``values`` is left as it was.  Returns what
        :func:`encode_` returns for a compiled kernel to return (None outside one)."""
        if overwrite and not is_compiling() and not self.format.legacy:
            encode_into(values, self.codes, self.scales, self.format, small=small, mask=mask, work=work)
            return None
        return encode_(values, self.codes, self.scales, self.format, mask)

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
