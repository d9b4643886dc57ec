"""Stochastic rounding of float32 values to float16 or bfloat16, with element-wise ops native on DirectML.

Round-to-nearest loses every update smaller than half a unit in the last
place of a low-precision parameter: a bfloat16 weight of 1.0 ignores any
change below 2**-8.  Stochastic rounding keeps such updates *in expectation*:
a value ``x`` between two neighbours ``lo < x < hi`` of the target format
rounds up with probability ``(x - lo) / (hi - lo)`` and down otherwise, so
``E[round(x)] = x``, and no compensation buffer is needed (the precision mode
of torchao's bf16 optimizers; Kahan summation keeps a 2-byte buffer instead).

:func:`round_stochastic` writes the rounded values into a given float16 or
bfloat16 tensor, drawing one uniform number per element from a
``torch.Generator`` (reproducible under its seed).  Values the format holds
exactly (zeros of either sign included) and non-finite values (inf keeps its
sign; NaN stays NaN) are copied as they are, and consume a draw like every
other element.

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
(2**-24 for torch's float32 ``uniform_`` on the CPU and CUDA): always for
``|x|`` at least the format's smallest subnormal (``f`` has at most 23
fractional bits there: 13 and 16 in float16's and bfloat16's normal ranges);
below it (float16: ``|x| < 2**-24``), ``f`` is rounded up to that resolution,
a bias under 2**-24 of the smallest subnormal.

Ops (28 per call, whatever the size): ``abs``, ``copy_``, ``eq``,
``clamp_max``, ``gt``, ``mul``, ``where``, ``log2``, ``floor``,
``clamp_min``, ``sub``, ``exp2``, ``div``, ``uniform_``, ``lt``, ``add``,
``sign``, every one written into ``out`` or the kept scratch
(:class:`RoundingScratch`: three float32 and two bool tensors of the size,
14 bytes per element; pass one to make a call allocate nothing), and every one
native in torch-directml 0.2.5's dispatch table (tests/test_rounding.py
checks the recorded ops against it).  ``exp2`` must be exact at integers and
``log2`` within about 1e-4 of the truth (step 2's margin).  Under
flush-to-zero, bfloat16 values below 2**-119 (whose unit in the last place is
a float32 subnormal) are not rounded with these probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "RoundingScratch", "round_stochastic", "round_stochastic_new", "StochasticRounder",
           "write_rounded"]


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
    three float32 tensors and two bool ones (14 bytes per element).  A call on fewer elements uses their
    leading parts."""

    def __init__(self, numel: int, device: torch.device | str = "cpu"):
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        device = torch.device(device)
        self.numel = numel
        self.device = device
        self.f32 = tuple(torch.empty(numel, dtype=torch.float32, device=device) for _ in range(3))
        self.masks = tuple(torch.empty(numel, dtype=torch.bool, device=device) for _ in range(2))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.f32, *self.masks))

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` elements of each tensor: three float32, then two bool."""
        if n > self.numel:
            raise ValueError(f"the scratch holds {self.numel} elements, the call needs {n}")
        return tuple(t[:n] for t in (*self.f32, *self.masks))


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
                     scratch: RoundingScratch | None = None) -> torch.Tensor:
    """Round the float32 tensor ``x`` stochastically into ``out`` (float16 or bfloat16, same shape and
    device, both contiguous); return ``out``.

    Each element becomes its lower neighbour ``lo`` or upper neighbour ``hi`` in ``out``'s format, ``hi``
    with probability ``(x - lo) / (hi - lo)`` (one ``uniform_`` draw per element from ``generator``, or
    torch's default generator); representable and non-finite values are copied as they are.  ``x`` is
    not written.  ``scratch``: a :class:`RoundingScratch` of at least ``x.numel()`` elements on the
    device (without one, the call allocates its temporaries).  See the module's docstring for the method.
    """
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
    C.uniform_(0.0, 1.0, generator=generator)                 # u
    torch.lt(C, B, out=flag)                                  # up with probability f
    torch.add(A, flag, out=A)                                 # k or k + 1
    C.copy_(of)
    torch.mul(A, C, out=A)                                    # lo or hi (may be the overflow: inf below)
    torch.sign(xf, out=C)
    torch.mul(A, C, out=A)                                    # the sign back (a negative value to 0: -0.0)
    torch.where(keep, xf, A, out=A)
    of.copy_(A)                                               # exact: A holds values of the format
    return out


def round_stochastic_new(x: torch.Tensor, dtype: torch.dtype, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`round_stochastic` into a new tensor of ``dtype`` (allocates it and the temporaries)."""
    if dtype not in FORMATS:
        raise TypeError(f"dtype must be float16 or bfloat16, got {dtype}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return round_stochastic(x.contiguous() if isinstance(x, torch.Tensor) else x, out, generator=generator)


class StochasticRounder:
    """What an optimizer's step needs to write parameters with ``rounding="stochastic"`` on one device: a
    ``torch.Generator`` (one per optimizer and device, seeded from ``seed``; its state is saved in the
    optimizer's ``state_dict``) and a :class:`RoundingScratch` kept between steps, sized to the largest
    range rounded so far (the eager step's chunk: bounded).  Calling it rounds ``values`` (float32) into
    ``out`` (float16/bfloat16) with :func:`round_stochastic`."""

    def __init__(self, device: torch.device | str, seed: int):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.scratch: RoundingScratch | None = None

    def __call__(self, values: torch.Tensor, out: torch.Tensor) -> None:
        n = values.numel()
        if self.scratch is None or self.scratch.numel < n:
            self.scratch = RoundingScratch(n, self.device)
        round_stochastic(values.reshape(-1), out.view(-1), generator=self.generator, scratch=self.scratch)

    def get_state(self) -> torch.Tensor:
        """The generator's state (a CPU uint8 tensor, as ``torch.Generator.get_state`` returns it)."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state.to("cpu", torch.uint8))


def write_rounded(values: torch.Tensor, out: torch.Tensor, rounder: StochasticRounder | None) -> None:
    """Write the update's ``values`` (the compute dtype) into the parameters ``out``: to the nearest value
    (``out.copy_``), or stochastically when ``rounder`` is given and ``out`` is float16/bfloat16 while
    ``values`` is float32 (the call site of :func:`dml_optim.core.update.run_rule`)."""
    if rounder is not None and out.dtype in FORMATS and values.dtype == torch.float32:
        rounder(values, out)
    else:
        out.copy_(values)
