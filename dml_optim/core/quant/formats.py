"""The quantized states' formats: blocks, codebooks and their levels (pure Python: no tensor here).

:data:`BLOCK`, :data:`MIN_ELEMENTS`, :class:`StateFormat` (one state's code: its bits, sign, kind, levels and
bounds), the three codebooks (:data:`CODEBOOKS`), :func:`format_for` (the format of a state in the codebook new
states use, :func:`active_codebook`; :func:`use_codebook` switches it) and :func:`format_named`.

Long by design: three codebooks, each format's closed-form levels and error bounds (see the package docstring).
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass

__all__ = ["BLOCK", "MIN_ELEMENTS", "CODEBOOK", "SECOND_CODEBOOK", "LEGACY_CODEBOOK", "CODEBOOKS", "StateFormat",
           "format_for", "format_named", "active_codebook", "use_codebook"]

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


#: The codebook new states are created in (:func:`format_for`'s default, :func:`active_codebook`), and the name a
#: checkpoint of them carries (``state_dict()["dml_optim"]["quantization"]``); a checkpoint of the first codebook
#: is read with its own formats and encoded again in this one.
_ACTIVE = [CODEBOOK]


def active_codebook() -> str:
    """The codebook new states are created in (:data:`CODEBOOK` unless :func:`use_codebook` says otherwise)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def use_codebook(name: str):
    """Within it, new states are created in codebook ``name`` (to compare codebooks on the same batches)."""
    if name not in CODEBOOKS:
        raise ValueError(f"unknown quantized state codebook {name!r} (known: {', '.join(CODEBOOKS)})")
    saved, _ACTIVE[0] = _ACTIVE[0], name
    try:
        yield
    finally:
        _ACTIVE[0] = saved


def format_for(bits: int, signed: bool, codebook: str | None = None) -> StateFormat:
    """The format of a ``bits``-bit state (``signed`` for the first moment, unsigned for the second) in
    ``codebook`` (default :func:`active_codebook`; a checkpoint names its own)."""
    codebook = _ACTIVE[0] if codebook is None else codebook
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
