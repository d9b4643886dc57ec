"""Stochastic rounding of float32 values to float16 or bfloat16, with element-wise ops native on DirectML.

Round-to-nearest loses every update smaller than half a unit in the last
place of a low-precision parameter: a bfloat16 weight of 1.0 ignores any
change below 2**-8.  Stochastic rounding keeps such updates *in expectation*:
a value ``x`` between two neighbours ``lo < x < hi`` of the target format
rounds up with probability ``(x - lo) / (hi - lo)`` and down otherwise, so
``E[round(x)] = x``, and no compensation buffer is needed (the precision mode
of torchao's bf16 optimizers; Kahan summation keeps a 2-byte buffer instead).

:func:`round_stochastic` writes the rounded values into a given float16 or
bfloat16 tensor, with one uniform number per element: keyed on a counter
(:class:`Draws`: a seed, a stream, a step count and each element's index,
:func:`counter_uniform`), which is what an optimizer uses, or drawn from a
``torch.Generator``.  Values the format holds exactly (zeros of either sign
included) and non-finite values (inf keeps its sign; NaN stays NaN) are copied
as they are, and consume a number like every other element.

**Counter-based numbers** (:func:`counter_uniform`).  The number of element
``i`` at step count ``t`` is a hash of ``(seed, stream, t, i)``, computed with
element-wise integer ops that DirectML runs natively (int32 multiplies, which
wrap, ``xor``, ``and``, and floor divisions by powers of two for the right
shifts: DirectML sends shifts to the CPU).  So the numbers need no device
generator (plugins before torch-directml 0.2.5 had none, and ignored seeds),
they are the same on every device and in every order the elements are
stepped in (the step inside backward draws what a plain step draws), and a
run resumed from a checkpoint draws what the uninterrupted run would, from the
seed alone.  The hash is Chris Wellons' ``lowbias32`` (``x ^= x >> 16; x *=
0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``) of ``i *
0x9e3779b9 + key``, ``key`` mixing the seed, stream and count on the host
(splitmix64) or, for a count kept on the device, one ``add``; the number is
the hash's top 24 bits times ``2**-24``: uniform on the multiples of
``2**-24`` in ``[0, 1)``, the resolution of torch's float32 ``uniform_``.

**How, without bit tricks.** Adding random bits to the float32 pattern and
masking the low ones is the usual way for bfloat16, but float16's subnormals
need a mask that depends on the exponent (a shift: a CPU fallback on
DirectML), and DirectML has no bfloat16 at all.  This is arithmetic instead,
exact for both formats, on magnitudes ``a = |x|``:

1. ``r = |round_to_nearest(x)|`` (the format's own conversion, through
   ``out``), an inf from overflow clamped to the largest finite value;
2. the binade of ``lo``, the largest representable value ``<= a``: when
   ``r > a``, ``lo`` is ``r``'s lower neighbour, in the binade of
   ``r * (1 - 2**-(p+2))``, else ``r``'s, that of ``r * (1 + 2**-(p+2))``
   (``p`` mantissa bits): ``floor(log2(.))`` of those is exact for any value
   of the format, far (>= 2**-(p+2) / ln 2) from an integer, and clamped below
   at the format's smallest normal exponent (subnormals share its spacing);
3. ``ulp = 2**(e - p)``; ``s = a / ulp`` is exact (a power of two), ``k =
   floor(s)`` gives ``lo = k * ulp`` and ``f = s - k`` the probability,
   exact too;
4. ``k + (u < f)`` with ``u`` uniform in ``[0, 1)``, times ``ulp`` and the
   sign of ``x``: the result is representable, so the final conversion
   into ``out`` is exact.  Above the largest finite value the upper neighbour
   is the format's overflow (``2**16`` for float16, ``2**128`` for
   bfloat16), which converts to inf.

``P(u < f) = f`` exactly while ``f`` is a multiple of the draw's resolution
(2**-24: the counter's numbers, and torch's float32 ``uniform_`` on the CPU and CUDA): always for
``|x|`` at least the format's smallest subnormal (``f`` has at most 23
fractional bits there: 13 and 16 in float16's and bfloat16's normal ranges);
below it (float16: ``|x| < 2**-24``), ``f`` is rounded up to that resolution,
a bias under 2**-24 of the smallest subnormal.

Ops (28 per call with a generator, 45 with counter-based numbers, whatever
the size): ``abs``, ``copy_``, ``eq``, ``clamp_max``, ``gt``, ``mul``,
``where``, ``log2``, ``floor``, ``clamp_min``, ``sub``, ``exp2``, ``div``,
``lt``, ``add``, ``sign``, and ``uniform_`` or the counter's ``arange``,
``mul``, ``add``, ``floor_divide``, ``bitwise_and``, ``bitwise_xor``, every
one written into ``out`` or the kept scratch (:class:`RoundingScratch`: three
float32, two bool and two int32 tensors of the size, 22 bytes per element;
pass one to make a call allocate nothing), and every one native in
torch-directml 0.2.5's dispatch table (tests/test_rounding.py checks the
recorded ops against it).  ``exp2`` must be exact at integers and
``log2`` within about 1e-4 of the truth (step 2's margin).  Under
flush-to-zero, bfloat16 values below 2**-119 (whose unit in the last place is
a float32 subnormal) are not rounded with these probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["FORMATS", "RoundingScratch", "round_stochastic", "round_stochastic_new", "StochasticRounder",
           "RoundingKey", "write_rounded", "Draws", "counter_uniform", "draw_key"]

_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1
#: the hash's multipliers, as int32 values (two's complement): lowbias32's, and the golden ratio's that spreads
#: consecutive indices (0x9e3779b9 - 2**32)
_MUL1, _MUL2, _SPREAD = 0x21F0AAAD, 0x735A2D97, 0x9E3779B9 - (1 << 32)


def _int32(v: int) -> int:
    """``v`` mod 2**32 as a signed 32-bit value."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


def _splitmix64(v: int) -> int:
    v = (v + 0x9E3779B97F4A7C15) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return v ^ (v >> 31)


class Draws(NamedTuple):
    """What a call's counter-based numbers are keyed on (:func:`counter_uniform`): the rounder's ``seed``, a
    ``stream`` (one per flat buffer), the step ``count`` (an int, or a 0-d integer tensor on the device: a count
    kept there) and ``start``, the index of the call's first element; element ``j`` of the call is index
    ``start + j`` (``start`` may be a list of ``(first element, last element + 1, index of the first)`` runs
    when the indices are not consecutive: a re-packed buffer)."""

    seed: int
    stream: int
    count: "int | torch.Tensor"
    start: "int | tuple"


def draw_key(seed: int, stream: int, count: int = 0) -> int:
    """The 32-bit key (a signed int32 value) of ``(seed, stream, count)``: splitmix64 of the three."""
    v = _splitmix64(seed & _M64)
    v = _splitmix64(v ^ (stream & _M64))
    v = _splitmix64(v ^ (count & _M64))
    return _int32(v ^ (v >> 32))


@dataclass(frozen=True)
class _Format:
    mantissa: int  # stored fraction bits (p)
    emin: int  # exponent of the smallest normal value
    max: float  # largest finite value


#: The low-precision formats :func:`round_stochastic` writes.
FORMATS = {
    torch.float16: _Format(10, -14, 65504.0),
    torch.bfloat16: _Format(7, -126, float(torch.finfo(torch.bfloat16).max)),
}


class RoundingScratch:
    """The temporaries of :func:`round_stochastic` for up to ``numel`` elements on ``device``, kept between calls:
    three float32 tensors, two bool ones and two int32 ones (the counter's hash; 22 bytes per element).  A call
    on fewer elements uses their leading parts."""

    def __init__(self, numel: int, device: torch.device | str = "cpu"):
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        device = torch.device(device)
        self.numel = numel
        self.device = device
        self.f32 = tuple(torch.empty(numel, dtype=torch.float32, device=device) for _ in range(3))
        self.masks = tuple(torch.empty(numel, dtype=torch.bool, device=device) for _ in range(2))
        self.ints = tuple(torch.empty(numel, dtype=torch.int32, device=device) for _ in range(2))
        self.masks32 = masks32(device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.f32, *self.masks, *self.ints))

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` elements of each tensor: three float32, then two bool."""
        if n > self.numel:
            raise ValueError(f"the scratch holds {self.numel} elements, the call needs {n}")
        return tuple(t[:n] for t in (*self.f32, *self.masks))

    def int_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` elements of the two int32 tensors (:func:`counter_uniform`'s work)."""
        if n > self.numel:
            raise ValueError(f"the scratch holds {self.numel} elements, the call needs {n}")
        return self.ints[0][:n], self.ints[1][:n]


def masks32(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hash's bit masks (``2**16 - 1``, ``2**17 - 1``, ``2**24 - 1``) as 0-d int32 tensors on ``device``: an
    ``and`` with a tensor is ``bitwise_and.Tensor_out``, native on DirectML (with a Python int it is
    ``bitwise_and.Scalar_out``, a composite the dispatch table does not resolve)."""
    masks = torch.tensor([(1 << 16) - 1, (1 << 17) - 1, (1 << 24) - 1], dtype=torch.int32, device=device)
    return masks[0], masks[1], masks[2]


def _shift_xor(x: torch.Tensor, t: torch.Tensor, bits: int, mask: torch.Tensor) -> None:
    """``x ^= x >> bits`` (logical, on int32 in place): the floor division is an arithmetic shift, ``mask``
    (``2**(32 - bits) - 1``) makes it logical (DirectML sends shift ops to the CPU; these three are native)."""
    torch.floor_divide(x, 1 << bits, out=t)
    torch.bitwise_and(t, mask, out=t)
    torch.bitwise_xor(x, t, out=x)


def counter_uniform(out: torch.Tensor, draws: Draws, work: tuple[torch.Tensor, torch.Tensor] | None = None,
                    masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Fill the float32 tensor ``out`` (1-d) with the counter-based numbers of ``draws`` (see the module's
    docstring): element ``j`` gets ``lowbias32(index * 0x9e3779b9 + key)``'s top 24 bits times ``2**-24``, a
    multiple of ``2**-24`` in ``[0, 1)``.  ``work``: two int32 tensors of ``out``'s size, ``masks``:
    :func:`masks32` on its device (each made if None).  Element-wise integer ops only (18 with a host count),
    every one native on DirectML."""
    n = out.numel()
    if work is None:
        work = (torch.empty(n, dtype=torch.int32, device=out.device), torch.empty(n, dtype=torch.int32, device=out.device))
    if masks is None:
        masks = masks32(out.device)
    m16, m17, m24 = masks
    x, t = work
    count = draws.count
    host = not isinstance(count, torch.Tensor)
    key = draw_key(draws.seed, draws.stream, int(count) if host else 0)
    start = draws.start
    if isinstance(start, int):
        _arange32(x, start)
    else:  # runs of consecutive indices
        for a, b, first in start:
            _arange32(x[a:b], first)
    torch.mul(x, _SPREAD, out=x)
    torch.add(x, key, out=x)
    if not host:  # (a count on the device: its part of the key added there, times an odd constant)
        c = t[:1]
        c.copy_(count.reshape(1))
        torch.mul(c, _int32(0x85EBCA6B), out=c)
        torch.add(x, c, out=x)
    _shift_xor(x, t, 16, m16)
    torch.mul(x, _MUL1, out=x)
    _shift_xor(x, t, 15, m17)
    torch.mul(x, _MUL2, out=x)
    _shift_xor(x, t, 15, m17)
    torch.floor_divide(x, 256, out=x)  # the top 24 bits (an arithmetic shift: [-2**23, 2**23))
    torch.bitwise_and(x, m24, out=x)
    out.copy_(x)
    return out.mul_(2.0 ** -24)


def _arange32(x: torch.Tensor, first: int) -> None:
    """``x`` = the indices ``first, first + 1, ...`` mod 2**32, as int32 (one ``arange``; a range crossing
    2**31 wraps as the hash's arithmetic does)."""
    n = x.numel()
    lo = _int32(first)
    if lo + n <= (1 << 31):
        torch.arange(lo, lo + n, dtype=torch.int32, out=x)
    else:  # (crosses 2**31: the wrap of int32 addition)
        torch.arange(0, n, dtype=torch.int32, out=x)
        torch.add(x, lo, out=x)


def _check(x: torch.Tensor, out: torch.Tensor, scratch: RoundingScratch | None) -> _Format:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"x must be a float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(out, torch.Tensor) or out.dtype not in FORMATS:
        raise TypeError(f"out must be a float16 or bfloat16 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != x.shape:
        raise ValueError(f"out's shape {tuple(out.shape)} differs from x's {tuple(x.shape)}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("x and out must be contiguous (views of a flat buffer are)")
    if scratch is not None and scratch.device != x.device:
        raise ValueError(f"the scratch is on {scratch.device}, x on {x.device}")
    return FORMATS[out.dtype]


def round_stochastic(x: torch.Tensor, out: torch.Tensor, *, generator: torch.Generator | None = None,
                     draws: Draws | None = None, scratch: RoundingScratch | None = None) -> torch.Tensor:
    """Round the float32 tensor ``x`` stochastically into ``out`` (float16 or bfloat16, same shape and
    device, both contiguous); return ``out``.

    Each element becomes its lower neighbour ``lo`` or upper neighbour ``hi`` in ``out``'s format, ``hi``
    with probability ``(x - lo) / (hi - lo)``, with one uniform number per element: the counter-based numbers
    of ``draws`` (:func:`counter_uniform`; what an optimizer passes), else one ``uniform_`` draw from
    ``generator`` (or torch's default generator); representable and non-finite values are copied as they
    are.  ``x`` is not written.  ``scratch``: a :class:`RoundingScratch` of at least ``x.numel()`` elements on
    the device (without one, the call allocates its temporaries).  See the module's docstring for the method.
    """
    if draws is not None and generator is not None:
        raise ValueError("give draws (counter-based numbers) or a generator, not both")
    fmt = _check(x, out, scratch)
    n = x.numel()
    if n == 0:
        return out
    if scratch is None:
        scratch = RoundingScratch(n, x.device)
    A, B, C, keep, flag = scratch.views(n)
    xf, of = x.view(-1), out.view(-1)
    p = fmt.mantissa
    torch.abs(xf, out=A)                                      # a = |x|
    of.copy_(xf)                                              # round to nearest, in the format
    B.copy_(of)
    torch.abs(B, out=B)                                       # r = |nearest|
    torch.eq(B, A, out=keep)                                  # exact (and inf): copied as they are
    torch.clamp_max(B, fmt.max, out=B)                        # an overflow's inf: the largest finite value
    torch.gt(B, A, out=flag)                                  # r above a: lo is r's lower neighbour
    torch.mul(B, 1.0 - 2.0 ** -(p + 2), out=C)
    torch.mul(B, 1.0 + 2.0 ** -(p + 2), out=B)
    torch.where(flag, C, B, out=C)                            # a value inside lo's binade, off its ends
    torch.log2(C, out=C)
    torch.floor(C, out=C)
    torch.clamp_min(C, float(fmt.emin), out=C)                # subnormals: the smallest normal's spacing
    torch.sub(C, float(p), out=C)
    torch.exp2(C, out=C)                                      # ulp = 2**(e - p), exact
    torch.div(A, C, out=B)                                    # s = a / ulp, exact
    of.copy_(C)                                               # ulp kept in out (a power of two the format holds)
    torch.floor(B, out=A)                                     # k: lo = k * ulp
    torch.sub(B, A, out=B)                                    # f = (a - lo) / ulp
    if draws is not None:                                     # u
        counter_uniform(C, draws, scratch.int_views(n), scratch.masks32)
    else:
        C.uniform_(0.0, 1.0, generator=generator)
    torch.lt(C, B, out=flag)                                  # up with probability f
    torch.add(A, flag, out=A)                                 # k or k + 1
    C.copy_(of)
    torch.mul(A, C, out=A)                                    # lo or hi (may be the overflow: inf below)
    torch.sign(xf, out=C)
    torch.mul(A, C, out=A)                                    # the sign back (a negative value to 0: -0.0)
    torch.where(keep, xf, A, out=A)
    of.copy_(A)                                               # exact: A holds values of the format
    return out


def round_stochastic_new(x: torch.Tensor, dtype: torch.dtype, *, generator: torch.Generator | None = None,
                         draws: Draws | None = None) -> torch.Tensor:
    """:func:`round_stochastic` into a new tensor of ``dtype`` (allocates it and the temporaries)."""
    if dtype not in FORMATS:
        raise TypeError(f"dtype must be float16 or bfloat16, got {dtype}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return round_stochastic(x.contiguous() if isinstance(x, torch.Tensor) else x, out, generator=generator,
                            draws=draws)


class StochasticRounder:
    """What an optimizer's step needs to write parameters with ``rounding="stochastic"`` on one device: the
    ``seed`` its counter-based numbers are keyed on (one per optimizer and device; saved in the optimizer's
    ``state_dict``) and a :class:`RoundingScratch` kept between steps, sized to the largest range rounded so
    far (the eager step's chunk: bounded).  Calling it rounds ``values`` (float32) into ``out``
    (float16/bfloat16) with :func:`round_stochastic`, the numbers keyed on ``(seed, stream, count, start)``:
    no device generator (plugins before torch-directml 0.2.5 had none), and the same numbers whatever order the
    ranges are stepped in."""

    def __init__(self, device: torch.device | str, seed: int):
        self.device = torch.device(device)
        self.seed = int(seed) & _M64
        self.scratch: RoundingScratch | None = None

    def __call__(self, values: torch.Tensor, out: torch.Tensor, *, stream: int, count, start) -> None:
        n = values.numel()
        if self.scratch is None or self.scratch.numel < n:
            self.scratch = RoundingScratch(n, self.device)
        round_stochastic(values.reshape(-1), out.view(-1), draws=Draws(self.seed, stream, count, start),
                         scratch=self.scratch)


class RoundingKey(NamedTuple):
    """Where a range's numbers come from (:func:`write_rounded`): the buffer's rounder and stream, the range's
    step ``count`` (an int, or a 0-d tensor on the device) and the index of its first element (or runs, see
    :class:`Draws`)."""

    rounder: StochasticRounder
    stream: int
    count: "int | torch.Tensor"
    start: "int | tuple"


def write_rounded(values: torch.Tensor, out: torch.Tensor, key: RoundingKey | None) -> None:
    """Write the update's ``values`` (the compute dtype) into the parameters ``out``: to the nearest value
    (``out.copy_``), or stochastically when ``key`` is given and ``out`` is float16/bfloat16 while
    ``values`` is float32 (the call site of :func:`dml_optim.core.update.run_rule`)."""
    if key is not None and out.dtype in FORMATS and values.dtype == torch.float32:
        key.rounder(values, out, stream=key.stream, count=key.count, start=key.start)
    else:
        out.copy_(values)
