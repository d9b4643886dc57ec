"""Stochastic rounding (dml_optim/core/rounding.py): probabilities, exactness, reproducibility, native ops.

The statistical tests use fixed seeds (so they are deterministic) and a
tolerance of Z binomial standard deviations: with ``N`` draws of a value whose
probability of rounding up is ``f``, the fraction of ups has standard
deviation ``sqrt(f (1 - f) / N)`` and the mean of the rounded values
``ulp * sqrt(f (1 - f) / N)``.
"""

from __future__ import annotations

import copy
import io
import math
import re

import numpy as np
import pytest
import torch

from dml_optim.core.opcount import OpRecorder
from dml_optim.core.rounding import (FORMATS, Draws, RoundingScratch, counter_uniform, draw_key, round_stochastic,
                                     round_stochastic_new)
from dml_optim.dml.dispatch import Resolver

DTYPES = (torch.float16, torch.bfloat16)
#: Standard deviations allowed (per value tested; about 6e-7 two-sided each under the normal approximation).
Z = 5.0


def _draws(x: torch.Tensor, dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` independent roundings of ``x`` (float32, 1-D), as float64, shape (n, len(x)): one call over ``x``
    repeated ``n`` times, so every draw of a value comes from its own uniform number."""
    g = torch.Generator().manual_seed(seed)
    out = round_stochastic_new(x.repeat(n), dtype, generator=g)
    return out.double().view(n, -1)


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo <= x <= hi``, the neighbours of finite float32 ``x`` in ``dtype`` (float64), from the bit
    patterns of the nearest value (the next pattern up or down in magnitude); an overflow's upper
    neighbour is inf."""
    near = x.to(dtype)
    bits = near.view(torch.int16).to(torch.int32)
    nearf = near.double()
    xd = x.double()
    # one pattern further from zero, or nearer to it, by the side x lies on
    away = torch.where(xd.abs() > nearf.abs(), 1, -1)
    other_bits = torch.where(nearf == 0, torch.where(xd < 0, 0x8001, 1).to(torch.int32), bits + away)
    other = other_bits.to(torch.int16).view(dtype).double()
    over = nearf.isinf()
    big = torch.tensor(FORMATS[dtype].max, dtype=torch.float64)
    nearf = torch.where(over, big.copysign(xd), nearf)
    other = torch.where(over, nearf * math.inf, other)
    lo, hi = torch.minimum(nearf, other), torch.maximum(nearf, other)
    exact = nearf == xd
    return torch.where(exact, xd, lo), torch.where(exact, xd, hi)


def _ulps(dtype: torch.dtype) -> float:
    return 2.0 ** -FORMATS[dtype].mantissa


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_representable_value_is_exact(dtype):
    """Every bit pattern of the format (subnormals, both zeros, the largest values, infinities) converted
    to float32 comes back bit for bit; NaNs stay NaN."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = patterns.float()
    out = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(0))
    nan = x.isnan()
    assert torch.equal(out[nan].isnan(), torch.ones(int(nan.sum()), dtype=torch.bool))
    assert torch.equal(out[~nan].view(torch.int16), patterns[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_always_a_neighbour(dtype):
    """Over values spread across 60 binades (and float16's subnormal range), each result is the lower or the
    upper neighbour of the value in the format, never anything else."""
    g = torch.Generator().manual_seed(1)
    lo_exp = -30 if dtype == torch.float16 else -60
    mag = torch.exp2(torch.empty(4096).uniform_(lo_exp, 15, generator=g))
    x = mag * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    lo, hi = _neighbours(x, dtype)
    out = _draws(x, dtype, 16)
    assert bool(((out == lo) | (out == hi)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [2.0 ** -10, 0.125, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_fraction_of_ups_is_the_probability(dtype, f, sign):
    """``x = lo + f * (hi - lo)`` for ``lo`` of several magnitudes: the fraction of draws landing on ``hi``
    is ``f`` within Z binomial standard deviations (N = 20,000 draws per value)."""
    p = FORMATS[dtype].mantissa
    n = 20_000
    los = torch.tensor([1.0, 1.5, 3.0 * 2.0 ** -9, 1234.0 if dtype == torch.float16 else 2.0 ** 70, 2.0 ** -5],
                       dtype=torch.float64)
    los = los.to(dtype).double()  # values of the format
    ulp = torch.exp2(torch.floor(torch.log2(los)) - p)
    x = (sign * (los + f * ulp)).float()
    f = (x.double().abs() - los) / ulp  # the probability of the float32 value (0.3 is not exact)
    out = _draws(x, dtype, n, seed=2)
    ups = (out.abs() > los).double().mean(0)
    sigma = torch.sqrt(f * (1 - f) / n)
    assert torch.all((ups - f).abs() <= Z * sigma), (ups, f, sigma)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbiased_in_expectation(dtype):
    """Many draws of one update: 512 random values (magnitudes over 12 binades, both signs); the mean of
    N = 4,000 draws of each is the value within Z standard deviations of that mean
    (``(hi - lo) * sqrt(f (1 - f) / N)``, with ``f`` from the value's neighbours); round-to-nearest misses
    by far more."""
    g = torch.Generator().manual_seed(3)
    x = torch.exp2(torch.empty(512).uniform_(-6, 6, generator=g)) * torch.where(
        torch.rand(512, generator=g) < 0.5, -1.0, 1.0)
    lo, hi = _neighbours(x, dtype)
    f = (x.double() - lo) / (hi - lo)
    n = 4000
    mean = _draws(x, dtype, n, seed=4).mean(0)
    sigma = (hi - lo) * torch.sqrt(f * (1 - f) / n)
    err = (mean - x.double()).abs()
    assert torch.all(err <= Z * sigma + 1e-12 * x.double().abs())
    # the total error of all 512 means: far inside the bound, where round-to-nearest's total is biased
    nearest_err = (x.to(dtype).double() - x.double()).abs().sum()
    assert err.sum() < 0.25 * nearest_err


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulates_small_updates(dtype):
    """The case it exists for: 1.0 plus an update of a tenth of a unit in the last place, 1,000 times.
    Round-to-nearest never moves; stochastic rounding moves by about 100 units (in expectation exactly
    100: the standard deviation of the sum of 1,000 Bernoulli(0.1) is about 9.5)."""
    ulp = _ulps(dtype)
    g = torch.Generator().manual_seed(5)
    w_near = torch.ones(64, dtype=dtype)
    w_sr = torch.ones(64, dtype=dtype)
    scratch = RoundingScratch(64)
    for _ in range(1000):
        w_near = (w_near.float() + 0.1 * ulp).to(dtype)
        round_stochastic(w_sr.float() + 0.1 * ulp, w_sr, generator=g, scratch=scratch)
    assert torch.all(w_near == 1.0)
    moved = (w_sr.double() - 1.0) / ulp
    # once above 2.0 the unit doubles, which does not happen within 100 units of 2**-p
    assert abs(moved.mean().item() - 100.0) <= Z * 9.5 / math.sqrt(64)


def test_float16_subnormals_and_below():
    """float16's subnormal grid (2**-24): 3.25 units rounds to 3 or 4 units with P(4) = 0.25; a value of a
    quarter of the smallest subnormal rounds to it with probability 0.25, otherwise to zero (of its sign)."""
    tiny = 2.0 ** -24
    x = torch.tensor([3.25 * tiny, -3.25 * tiny, 0.25 * tiny, -0.25 * tiny, 1000.5 * tiny], dtype=torch.float32)
    n = 20_000
    out = _draws(x, torch.float16, n, seed=6)
    expect_hi = torch.tensor([4, -4, 1, -1, 1001], dtype=torch.float64) * tiny
    expect_lo = torch.tensor([3, -3, 0, -0.0, 1000], dtype=torch.float64) * tiny
    assert bool(((out == expect_hi) | (out == expect_lo)).all())
    fhi = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.5])
    ups = (out == expect_hi).double().mean(0)
    sigma = torch.sqrt(fhi * (1 - fhi) / n).double()
    assert torch.all((ups - fhi.double()).abs() <= Z * sigma)
    zeros = out[:, 3] == 0
    assert torch.all(torch.signbit(torch.tensor(out[:, 3][zeros].numpy())))  # -tiny rounds to -0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_rounds_to_inf_with_its_probability(dtype):
    """Above the largest finite value the upper neighbour is the format's overflow (float16: 2**16, one
    unit above 65504): a quarter of a unit above the maximum becomes inf with probability 0.25; far above,
    always; and so for negative values."""
    big = FORMATS[dtype].max
    unit = 2.0 ** (math.floor(math.log2(big)) - FORMATS[dtype].mantissa)
    x = torch.tensor([big + 0.25 * unit, -(big + 0.25 * unit), big * 8.0 if dtype == torch.float16 else 3.4e38],
                     dtype=torch.float32)
    n = 20_000
    out = _draws(x, dtype, n, seed=7)
    assert bool(((out[:, 0] == big) | (out[:, 0] == math.inf)).all())
    assert bool(((out[:, 1] == -big) | (out[:, 1] == -math.inf)).all())
    assert bool((out[:, 2] == math.inf).all()) or dtype == torch.bfloat16
    for col in (0, 1):
        frac = out[:, col].isinf().double().mean().item()
        assert abs(frac - 0.25) <= Z * math.sqrt(0.25 * 0.75 / n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values_pass_through(dtype):
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0], dtype=torch.float32)
    out = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(0))
    assert out[0] == math.inf and out[1] == -math.inf and out[2].isnan()
    assert out[3] == 0 and not torch.signbit(out[3]) and torch.signbit(out[4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reproducible_under_a_seed(dtype):
    """The same seed gives the same bits; another seed, other roundings; and the result differs from
    round-to-nearest (values a third of a unit above the lower neighbour: about a third of them go up)."""
    x = torch.linspace(1.0, 2.0, 10_001)
    a = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(11))
    b = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(11))
    c = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(12))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a, c)
    assert not torch.equal(a, x.to(dtype))
    torch.manual_seed(5)  # no generator: torch's default one, reproducible under torch.manual_seed
    d = round_stochastic_new(x, dtype)
    torch.manual_seed(5)
    assert torch.equal(d, round_stochastic_new(x, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_differs_from_round_to_nearest_where_it_should(dtype):
    """x a third of a unit above a value of the format: round-to-nearest always returns the lower value,
    stochastic rounding the upper one about a third of the time."""
    ulp = _ulps(dtype)
    x = torch.full((30_000,), 1.0 + ulp / 3, dtype=torch.float32)
    assert torch.all(x.to(dtype) == 1.0)
    out = round_stochastic_new(x, dtype, generator=torch.Generator().manual_seed(13))
    frac = (out > 1.0).double().mean().item()
    assert abs(frac - 1 / 3) <= Z * math.sqrt(2 / 9 / 30_000)


class _Ops(OpRecorder):
    """Records each op with its arguments and the storages its outputs live in."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_op(self, func, args, kwargs, out):
        super().on_op(func, args, kwargs, out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((func, args, kwargs, [o.untyped_storage().data_ptr() for o in outs
                                                 if isinstance(o, torch.Tensor) and o.dim() > 0]))


@pytest.mark.parametrize("numbers", ["counter", "generator"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("whole", [True, False], ids=["scratch-of-the-size", "larger-scratch"])
def test_every_op_is_native_on_directml_and_nothing_is_allocated(dtype, whole, numbers):
    """The ops a call dispatches, resolved with torch-directml 0.2.5's dispatch table (composites through
    their decompositions): all native (float16 is the format DirectML has; bfloat16 runs the same ops), with
    counter-based numbers (what an optimizer uses) or a generator's.  With a kept scratch every output is
    written into ``out`` or the scratch: no allocation."""
    n = 4096
    x = torch.randn(n) * 3
    out = torch.empty(n, dtype=dtype)
    scratch = RoundingScratch(n if whole else 2 * n)
    rec = _Ops()
    source = (dict(draws=Draws(7, 1, 5, 1000)) if numbers == "counter"
              else dict(generator=torch.Generator().manual_seed(0)))
    with rec:
        round_stochastic(x, out, scratch=scratch, **source)
    resolver = Resolver()
    kinds = {func.name(): resolver(func.name(), func, args, kwargs)[0] for func, args, kwargs, _ in rec.calls}
    assert kinds and all(k == "native" for k in kinds.values()), kinds
    assert rec.ops == (45 if numbers == "counter" else 28)
    own = {t.untyped_storage().data_ptr() for t in (x, out, *scratch.f32, *scratch.masks, *scratch.ints)}
    for func, _, _, ptrs in rec.calls:
        assert set(ptrs) <= own, f"{func.name()} allocated"


def test_matches_numpy_float16_neighbours():
    """An independent oracle for float16: numpy's nextafter brackets every value, and the result is one of
    the two."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-20, 12, (20_000,), generator=g).float()))
    xn = x.numpy()
    near = xn.astype(np.float16)
    toward = np.where(xn > near.astype(np.float32), np.float16(np.inf), np.float16(-np.inf)).astype(np.float16)
    other = np.nextafter(near, toward)
    out = round_stochastic_new(x, torch.float16, generator=g).numpy()
    exact = near.astype(np.float32) == xn
    ok = (out == near) | (out == other)
    assert ok.all() and (out[exact] == near[exact]).all()


def test_arguments_are_checked():
    x = torch.randn(8)
    with pytest.raises(TypeError, match="x must be a float32"):
        round_stochastic(x.double(), torch.empty(8, dtype=torch.float16))
    with pytest.raises(TypeError, match="out must be a float16 or bfloat16"):
        round_stochastic(x, torch.empty(8))
    with pytest.raises(ValueError, match="shape"):
        round_stochastic(x, torch.empty(9, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        round_stochastic(torch.randn(8, 2).t(), torch.empty(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="scratch holds 4"):
        round_stochastic(x, torch.empty(8, dtype=torch.float16), scratch=RoundingScratch(4))
    assert round_stochastic(torch.empty(0), torch.empty(0, dtype=torch.float16)).numel() == 0
    # any shape, written in place
    x2 = torch.randn(3, 5)
    out2 = torch.empty(3, 5, dtype=torch.bfloat16)
    assert round_stochastic(x2, out2) is out2


# -- the option: rounding="stochastic" on float16/bfloat16 parameters ---------------------------------------------

import dml_optim  # noqa: E402

#: Elements of the parameter: independent draws of one update.
N_OPTION = 1 << 15


def _sgd_step(dtype, delta: float, rounding: str, seed: int = 0, steps: int = 1) -> torch.Tensor:
    """A parameter of ``N_OPTION`` ones in ``dtype``, stepped by plain SGD (lr 1) with a gradient of ``delta``
    after ``torch.manual_seed(seed)`` (what seeds the optimizer's generator)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.ones(N_OPTION, dtype=dtype))
    opt = dml_optim.SGD([p], lr=1.0, rounding=rounding)
    for _ in range(steps):
        p.grad = torch.full_like(p, delta)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("dtype", DTYPES)
def test_option_is_unbiased_in_expectation(dtype):
    """An update of 0.3 units in the last place below 1.0: round-to-nearest loses it, every element stays 1; the
    stochastic mean over the draws (one per element) is 1 - update within Z standard deviations."""
    ulp = 2.0 ** -(FORMATS[dtype].mantissa + 1)  # (below 1.0: the binade [0.5, 1))
    delta = 0.3 * ulp
    assert torch.equal(_sgd_step(dtype, delta, "nearest"), torch.ones(N_OPTION, dtype=dtype))
    out = _sgd_step(dtype, delta, "stochastic").double()
    assert set(out.unique().tolist()) == {1.0, 1.0 - ulp}  # always a neighbour
    sd = ulp * math.sqrt(0.3 * 0.7 / N_OPTION)
    assert abs(out.mean().item() - (1.0 - delta)) <= Z * sd


@pytest.mark.parametrize("dtype", DTYPES)
def test_option_is_exact_where_representable(dtype):
    ulp = 2.0 ** -(FORMATS[dtype].mantissa + 1)
    out = _sgd_step(dtype, 3 * ulp, "stochastic")
    assert torch.equal(out, torch.full((N_OPTION,), 1.0 - 3 * ulp, dtype=dtype))


def test_option_is_reproducible_under_a_seed_and_resumes_from_state_dict():
    """``torch.manual_seed`` before the optimizer is built fixes its seed; a checkpoint carries it
    (``rounding_seed``), so a resumed run draws what the uninterrupted one draws, bit for bit, whatever the
    process's seed then; without it the resumed run draws from its own seed."""
    dtype = torch.bfloat16
    delta = 0.3 * 2.0 ** -8
    a, b = _sgd_step(dtype, delta, "stochastic", seed=1), _sgd_step(dtype, delta, "stochastic", seed=1)
    assert torch.equal(a, b) and not torch.equal(a, _sgd_step(dtype, delta, "stochastic", seed=2))

    def model():
        torch.manual_seed(3)
        return torch.nn.Linear(64, 64).to(dtype)

    def steps(m, opt, rng):
        for i in rng:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(dtype)
            m(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    m1 = model()
    o1 = dml_optim.AdamW(m1.parameters(), lr=1e-3, rounding="stochastic")
    steps(m1, o1, range(2))
    saved = o1.state_dict()
    assert saved["dml_optim"]["rounding_seed"] == 3
    saved = torch.load(_saved(saved), weights_only=True)  # (the seed is a plain int: weights_only loads it)
    m2, m3 = model(), model()
    m2.load_state_dict(m1.state_dict())
    m3.load_state_dict(m1.state_dict())
    torch.manual_seed(99)  # (a resumed process seeds as it likes: the checkpoint's seed is the one drawn from)
    o2 = dml_optim.AdamW(m2.parameters(), lr=1e-3, rounding="stochastic")
    o2.load_state_dict(saved)
    o3 = dml_optim.AdamW(m3.parameters(), lr=1e-3, rounding="stochastic")  # (the states, not the seed)
    o3.load_state_dict({**saved, "dml_optim": {k: v for k, v in saved["dml_optim"].items() if k != "rounding_seed"}})
    for m, o in ((m1, o1), (m2, o2), (m3, o3)):
        steps(m, o, range(2, 4))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))


def _saved(state) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def _sr_model_and_optimizer():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = dml_optim.AdamW(m.parameters(), lr=1e-3, rounding="stochastic", state_bits=8)
    for _ in range(3):
        m(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def test_a_bad_rounding_seed_is_refused_before_anything_is_written():
    """A checkpoint whose ``rounding_seed`` is not an int raises a TypeError naming it, and leaves the optimizer
    as it was."""
    m, opt = _sr_model_and_optimizer()
    saved = opt.state_dict()
    m(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()  # (the optimizer moves on: the load below would take it back to step 3)
    params = [p.detach().clone() for p in m.parameters()]
    before = copy.deepcopy(opt.state_dict())
    bad = {**saved, "dml_optim": {**saved["dml_optim"], "rounding_seed": "seven"}}
    with pytest.raises(TypeError, match=r"\['rounding_seed'\]: the rounding seed must be an int, got str"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert float(after["state"][0]["step"]) == float(before["state"][0]["step"]) == 4.0
    for key in before["state"][0]:
        assert torch.equal(torch.as_tensor(after["state"][0][key]), torch.as_tensor(before["state"][0][key])), key
    assert after["dml_optim"]["rounding_seed"] == before["dml_optim"]["rounding_seed"]
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))


def test_a_checkpoint_with_the_old_generator_states_loads_and_says_it_cannot_continue_their_draws():
    """A checkpoint of the dml_optim that drew from generators (``rounding_generators``) loads, states and all,
    and warns once that the resumed run draws counter-based numbers from the current seed instead."""
    m, opt = _sr_model_and_optimizer()
    saved = opt.state_dict()
    meta = {k: v for k, v in saved["dml_optim"].items() if k != "rounding_seed"}
    old = {**saved, "dml_optim": {**meta, "rounding_generators": {"cpu": torch.Generator().get_state()}}}
    with pytest.warns(UserWarning, match="rounding_generators.*draws from seed 0"):
        opt.load_state_dict(old)
    assert opt.state_dict()["dml_optim"]["rounding_seed"] == 0


@pytest.mark.parametrize("options, match", [
    (dict(kahan=True), "kahan=True are alternatives"),
    (dict(master_weights=True), "master_weights=True are alternatives"),
    (dict(backend="compiled"), "runs on the eager backend"),
    (dict(), None),
])
def test_option_refusals_name_what_to_change(options, match):
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    if match is None:  # float32 parameters: refused at the first step, the parameter named
        q = torch.nn.Parameter(torch.zeros(8))
        q.grad = torch.ones(8)
        opt = dml_optim.AdamW([q], rounding="stochastic")
        with pytest.raises(ValueError, match=r'rounds float16 or bfloat16 parameters, got torch.float32 \(param_groups\[0\]'):
            opt.step()
        return
    with pytest.raises(ValueError, match=match):
        dml_optim.AdamW([p], rounding="stochastic", **options)


# -- counter-based numbers (issue 48, item 4) ---------------------------------------------------------


def _lowbias32_reference(seed: int, stream: int, count: int, start: int, n: int) -> np.ndarray:
    """The numbers of :func:`counter_uniform`, transcribed from its definition in uint32 NumPy arithmetic
    (wrapping multiplies, logical shifts): ``lowbias32(i * 0x9e3779b9 + key)``'s top 24 bits times 2**-24."""
    key = np.uint32(draw_key(seed, stream, count) & 0xFFFFFFFF)
    x = (np.arange(start, start + n, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = x * np.uint32(0x9E3779B9) + key
        x ^= x >> np.uint32(16)
        x = x * np.uint32(0x21F0AAAD)
        x ^= x >> np.uint32(15)
        x = x * np.uint32(0x735A2D97)
        x ^= x >> np.uint32(15)
    return (x >> np.uint32(8)).astype(np.float64) * 2.0 ** -24


@pytest.mark.parametrize("seed, stream, count, start", [
    (0, 0, 0, 0), (123456789, 7, 42, 10**6), (2**40 + 5, 3, 10**6, 2**31 - 5000), (1, 2, 3, 2**32 - 1000)])
def test_counter_numbers_are_the_hash_of_seed_stream_count_and_index(seed, stream, count, start):
    """int32 torch ops (DirectML's native ones) compute exactly the uint32 hash, across 2**31 and 2**32."""
    out = counter_uniform(torch.empty(20_000), Draws(seed, stream, count, start))
    assert np.array_equal(out.numpy().astype(np.float64), _lowbias32_reference(seed, stream, count, start, 20_000))


def test_counter_numbers_with_a_device_count_are_those_of_a_key_on_the_device():
    """A count kept on the device (a 0-d tensor) keys the numbers without a host read: reproducible, and another
    count gives other numbers."""
    a = counter_uniform(torch.empty(4096), Draws(5, 1, torch.tensor(7), 0))
    b = counter_uniform(torch.empty(4096), Draws(5, 1, torch.tensor(7), 0))
    c = counter_uniform(torch.empty(4096), Draws(5, 1, torch.tensor(8), 0))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert bool(((a * 2**24) == (a * 2**24).floor()).all()) and 0 <= float(a.min()) and float(a.max()) < 1


def test_counter_numbers_are_uniform_to_the_resolution_rounding_uses():
    """10**6 numbers (one call, consecutive indices): multiples of 2**-24 in [0, 1); the counts in 2**16 equal
    bins (float16's and bfloat16's fractions have 13 and 16 bits in their normal ranges) pass a chi-square test at
    6 standard deviations, and every one of the 16 lowest bits the rounding compares is set half the time (within
    5 binomial standard deviations)."""
    n = 1 << 20
    u = counter_uniform(torch.empty(n), Draws(2024, 3, 17, 5_000_000)).double()
    k = (u * 2**24).long()
    assert bool((k.double() == u * 2**24).all()) and int(k.min()) >= 0 and int(k.max()) < 2**24
    bins = torch.bincount(k >> 8, minlength=1 << 16).double()
    expected = n / (1 << 16)
    chi2 = float(((bins - expected) ** 2 / expected).sum())
    dof = (1 << 16) - 1
    assert abs(chi2 - dof) <= 6 * math.sqrt(2 * dof), chi2
    for bit in range(8, 24):
        ones = int(((k >> bit) & 1).sum())
        assert abs(ones - n / 2) <= 5 * math.sqrt(n / 4), (bit, ones)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_with_counter_numbers_is_unbiased_over_a_million_draws(dtype):
    """The mean rounding error (rounded - exact, in units in the last place) over 10**6 values at random
    fractions, rounded with counter-based numbers, is within 3 standard errors of 0."""
    n = 1 << 20
    g = torch.Generator().manual_seed(1)
    ulp = 2.0 ** -FORMATS[dtype].mantissa  # (the binade [1, 2))
    x = 1.0 + torch.rand(n, generator=g, dtype=torch.float64) * (1 - ulp)
    x = x.float()
    out = round_stochastic_new(x, dtype, draws=Draws(11, 0, 3, 0))
    err = (out.double() - x.double()) / ulp
    assert bool(((err > -1) & (err < 1)).all())
    se = float(err.std()) / math.sqrt(n)
    assert abs(float(err.mean())) <= 3 * se, (float(err.mean()), se)


def test_draws_and_a_generator_are_alternatives():
    with pytest.raises(ValueError, match="draws .* or a generator, not both"):
        round_stochastic_new(torch.ones(4), torch.float16, draws=Draws(0, 0, 0, 0), generator=torch.Generator())
