"""Precision configurations and the metrics of the comparison harness (issue 6).

Every metric is checked on a constructed case whose answer follows from
FP16's format by hand:

* FP16: smallest subnormal 2**-24 ≈ 5.96e-8, so a value below 2**-25 rounds
  to 0; the ULP of 1.0 is 2**-10 (2**-11 just below 1.0).
* epsilon 1e-8 < 2**-25 is 0 in FP16: a zero gradient gives m = v = 0 and
  the update m / (sqrt(v) + 0) is 0/0 = NaN at the first step.
* (1 - 0.999) * (1e-3)**2 = 1e-9 < 2**-25: flushed; (1 - 0.999) * (1e-2)**2 =
  1e-7 > 2**-25: kept (rounded to 2 * 2**-24).
* a step of 1e-5 from 1.0 is below half an ULP (2**-11 ≈ 4.9e-4): lost.
"""

from __future__ import annotations

import math

import pytest
import torch

import dml_optim
import dml_optim.backends.eager as engine
from dml_optim import precision as P
from dml_optim.optimizers.registry import NAMES
from tolerances import TOL
from introspect import buffers

F16_TINY = 2.0**-24


def _stream(values: list[float], grads: list[list[float]], name: str = "case") -> P.Stream:
    """A one-parameter stream with explicit per-step gradients."""
    init = torch.tensor(values, dtype=torch.float32)
    table = [torch.tensor(g, dtype=torch.float32) for g in grads]
    return P.Stream(name, init, [tuple(init.shape)], len(table), lambda t: table[t - 1])


def _run(optimizer, stream, names, hyper=None):
    results, skipped, _ = P.run_stream(optimizer, stream, [P.CONFIGS[n] for n in names], hyperparameters=hyper)
    return {r.config: r for r in results}, skipped


# -- the metric functions on hand-made values ------------------------------------------


def test_ulp_distance_counts_representable_values_between():
    x = torch.tensor([1.0, 1.0, -0.0, F16_TINY, 65504.0, float("nan")], dtype=torch.float16)
    ref = torch.tensor([1.0 + 2**-10, 1.0 + 3 * 2**-10, 0.0, -F16_TINY, float("inf"), 1.0], dtype=torch.float64)
    # 1 ULP, 3 ULPs, +0/-0 equal, across zero: one subnormal each side, max finite to inf: 1, NaN: -1
    assert P.ulp_distance(x, ref).tolist() == [1, 3, 0, 2, 1, -1]


def test_ulp_distance_rounds_the_reference_to_the_storage_dtype():
    x = torch.tensor([1.0], dtype=torch.float32)
    # 1 + 2**-30 rounds to 1.0 in float32: 0 ULPs; 1 + 2**-23 is the next float32: 1 ULP
    assert P.ulp_distance(x, torch.tensor([1.0 + 2**-30], dtype=torch.float64)).item() == 0
    assert P.ulp_distance(x, torch.tensor([1.0 + 2**-23], dtype=torch.float64)).item() == 1
    xb = torch.tensor([1.0], dtype=torch.bfloat16)  # bfloat16: 7 fraction bits, ULP of 1.0 is 2**-7
    assert P.ulp_distance(xb, torch.tensor([1.0 + 5 * 2**-7], dtype=torch.float64)).item() == 5


def test_relative_error_floor_and_nan():
    x = torch.tensor([1.1, 1e-9, float("nan")], dtype=torch.float64)
    ref = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    err = P.relative_error(x, ref).tolist()
    assert err[0] == pytest.approx(0.1, rel=1e-12)
    assert err[1] == pytest.approx(1e-9 / F16_TINY, rel=1e-12)  # denominator floored at 2**-24
    assert err[2] == math.inf


def test_lost_updates_and_flushed_entries_count_by_definition():
    x_prev = torch.tensor([1.0, 1.0, 1.0, 1.0])
    x = torch.tensor([1.0, 0.5, 1.0, 0.5])
    r_prev = torch.tensor([1.0, 1.0, 1.0, 1.0])
    r = torch.tensor([0.9, 0.9, 1.0, 1.0])
    # reference moved in elements 0, 1; of those, x stayed in element 0
    assert P.lost_updates(x_prev, x, r_prev, r) == (1, 2)
    state = torch.tensor([0.0, 1.0, 0.0, 0.0])
    ref_state = torch.tensor([1e-9, 1.0, 0.0, 2.0])
    assert P.flushed_entries(state, ref_state) == (2, 3)


def test_smallest_subnormal():
    assert P.smallest_subnormal(torch.float16) == 2.0**-24
    assert P.smallest_subnormal(torch.float32) == 2.0**-149


# -- the metrics through the harness, on constructed streams ------------------------------


def test_epsilon_underflow_gives_nan_at_step_1_in_fp16_arithmetic_only():
    # DmlAdam, epsilon 1e-8 (its default). Element 0 has gradient exactly 0:
    # m = v = 0, and in FP16 epsilon is 0, so the update is 0/0 at step 1.
    stream = _stream([0.5, 0.25, -0.5], [[0.0, 0.5, -0.25]] * 3)
    res, _ = _run("dml-adam", stream, ["fp16", "fp16-fp32compute", "fp32"])
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0.0
    fp16 = res["fp16"].metrics
    assert fp16["first_nonfinite_step"] == 1
    assert fp16["nan_count"] == 1 and fp16["inf_count"] == 0
    assert math.isnan(res["fp16"].curve[0])
    for name in ("fp16-fp32compute", "fp32"):  # FP32 arithmetic: epsilon is 1e-8, 0 / 1e-8 = 0
        m = res[name].metrics
        assert m["first_nonfinite_step"] is None and m["nan_count"] == 0 and m["inf_count"] == 0
    # an epsilon representable in FP16 avoids it
    res, _ = _run("dml-adam", stream, ["fp16"], {"epsilon": 1e-4})
    assert res["fp16"].metrics["first_nonfinite_step"] is None


def test_epsilon_underflow_plus_flushed_moment_gives_inf_at_step_1():
    # |g| = 1e-3: v = 1e-9 flushes to 0 in FP16 while m = 1e-4 does not: m / 0 = inf
    stream = _stream([0.5, 0.25], [[1e-3, 0.5]] * 2)
    res, _ = _run("dml-adam", stream, ["fp16"])
    m = res["fp16"].metrics
    assert m["first_nonfinite_step"] == 1 and m["inf_count"] == 1 and m["nan_count"] == 0


def test_tiny_gradients_flush_the_fp16_second_moment():
    # Adam, beta 0.999: 1e-3 -> (1 - beta) g^2 = 1e-9 < 2**-25: flushed;
    #                   1e-2 -> 1e-7 > 2**-25: kept.  So exactly half are flushed.
    g = [1e-3, -1e-3, 1e-2, -1e-2]
    stream = _stream([0.5, 0.5, 0.5, 0.5], [g] * 4)
    res, _ = _run("adam", stream, ["fp16", "fp16-fp32compute", "fp16-master", "fp32"])
    assert res["fp16"].metrics["flushed_second_moment_fraction"] == 0.5
    # FP32 arithmetic does not help: the result is stored in the FP16 state
    assert res["fp16-fp32compute"].metrics["flushed_second_moment_fraction"] == 0.5
    assert res["fp16-master"].metrics["flushed_second_moment_fraction"] == 0.0
    assert res["fp32"].metrics["flushed_second_moment_fraction"] == 0.0


def test_momentum_has_no_second_moment_metric():
    res, _ = _run("momentum", _stream([0.5], [[0.1]]), ["fp16"])
    assert res["fp16"].metrics["flushed_second_moment_fraction"] is None


def test_updates_below_half_an_ulp_are_lost():
    # plain SGD (Momentum with alpha 0, lr 1): the update is exactly the gradient.
    # At 1.0 (FP16 ULP 2**-10 above, 2**-11 below), a step of 1e-5 is lost; 1e-3 (> 2 ULPs) is not.
    stream = _stream([1.0, 1.0], [[1e-5, 1e-3]] * 5)
    res, _ = _run("momentum", stream, ["fp16", "fp32"], {"lr": 1.0, "alpha": 0.0})
    assert res["fp16"].metrics["lost_update_fraction"] == 0.5
    assert res["fp32"].metrics["lost_update_fraction"] == 0.0  # 1e-5 > half the FP32 ULP (2**-24)


def test_gradient_underflow_fraction():
    # 1e-8 < 2**-25 rounds to 0 in FP16; 1e-7 rounds to 2**-24 (kept)
    stream = _stream([0.5, 0.5], [[1e-8, 1e-7]] * 2)
    res, _ = _run("momentum", stream, ["fp16", "fp32"])
    assert res["fp16"].metrics["grad_underflow_fraction"] == 0.5
    assert res["fp32"].metrics["grad_underflow_fraction"] == 0.0


def test_kahan_keeps_the_updates_fp16_rounds_away():
    # plain SGD (Momentum, alpha 0, lr 1): each step subtracts the FP16 gradient 1e-4 (stored as 1.0002e-4).
    # By hand: at 1.0 half an FP16 ULP below is 2**-12 = 2.44e-4, so plain FP16 never moves (every update lost),
    # while Kahan's compensation sums the steps and moves the parameter once they pass half an ULP:
    # after 50 steps it is within one FP16 ULP below 1.0 (2**-11) of 1 - 50 * 1.0002e-4 = 0.9949990.
    stream = _stream([1.0], [[1e-4]] * 50)
    res, _ = _run("momentum", stream, ["fp16", "fp16-master", "fp16-kahan"], {"lr": 1.0, "alpha": 0.0})
    target = 1.0 - 50 * float(torch.tensor(1e-4, dtype=torch.float16))
    fp16, kahan = res["fp16"].metrics, res["fp16-kahan"].metrics
    assert fp16["lost_update_fraction"] == 1.0
    assert res["fp16"].curve[-1] == pytest.approx((1.0 - target) / target, rel=1e-3)  # stayed at 1.0
    assert res["fp16-kahan"].curve[-1] * target <= 2.0**-11
    assert res["fp16-master"].curve[-1] * target <= 2.0**-12  # master: FP32 sum, then rounded once
    # the parameter moved roughly once per ULP's worth of steps: most updates held back in the compensation
    assert 0.6 < kahan["lost_update_fraction"] < 1.0


def test_stochastic_rounding_keeps_the_updates_fp16_rounds_away_on_average():
    # the Kahan case above on 1024 copies of the parameter: each step of 1.0002e-4 is below half an FP16 ULP
    # at 1.0 (2**-12), so round-to-nearest never moves, while stochastic rounding moves by one ULP with the
    # probability of the step's size. By hand: each step's rounding error is below one ULP (2**-11 under 1.0),
    # of mean 0 and independent of the others, so after 40 steps the RMS error per copy is at most
    # 2**-11 * sqrt(40) / 2 ≈ 1.5e-3, against round-to-nearest's 40 * 1e-4 = 4e-3.
    n, steps = 1024, 40
    stream = _stream([1.0] * n, [[1e-4] * n] * steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as compare() runs buffers this small: thread hand-offs cost more than the ops)
    try:
        res, _ = _run("momentum", stream, ["fp16", "fp16-sr"], {"lr": 1.0, "alpha": 0.0})
    finally:
        torch.set_num_threads(threads)
    target = 1.0 - steps * float(torch.tensor(1e-4, dtype=torch.float16))
    assert res["fp16"].metrics["lost_update_fraction"] == 1.0
    assert res["fp16"].curve[-1] * target == pytest.approx(1.0 - target, rel=1e-3)  # stayed at 1.0
    sr = res["fp16-sr"]
    rms = sr.curve[-1] * target  # ||x - x_ref|| / ||x_ref|| with every x_ref = target: the RMS error per copy
    assert rms < 2.0**-11 * math.sqrt(steps) / 2
    assert 0 < sr.metrics["lost_update_fraction"] < 1.0  # moved at some steps, not at others


def test_directml_s_lean_configuration_rounds_stochastically_over_8_bit_states():
    """fp16-sr-8bit (float16 written by stochastic rounding, 8-bit states: DirectML's lean configuration, which has no
    bfloat16): the case above, whose momentum buffer (a block of equal values) the 8-bit code holds exactly, keeps
    the updates round-to-nearest loses, within the same bound; its states are stored in 8 bits."""
    config = P.CONFIGS["fp16-sr-8bit"]
    assert (config.param_dtype, config.state_bits, config.rounding, config.kahan) == (torch.float16, 8, "stochastic", False)
    n, steps = 1024, 40
    stream = _stream([1.0] * n, [[1e-4] * n] * steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res, skipped = _run("momentum", stream, ["fp16-sr-8bit"], {"lr": 1.0, "alpha": 0.0})
    finally:
        torch.set_num_threads(threads)
    assert not skipped
    target = 1.0 - steps * float(torch.tensor(1e-4, dtype=torch.float16))
    sr = res["fp16-sr-8bit"]
    assert sr.curve[-1] * target < 2.0**-11 * math.sqrt(steps) / 2
    assert 0 < sr.metrics["lost_update_fraction"] < 1.0
    opt = P.make_optimizer("adamw", [torch.nn.Parameter(torch.ones(8192, dtype=torch.float16))], config)
    opt.param_groups[0]["params"][0].grad = torch.full((8192,), 1e-3, dtype=torch.float16)
    opt.step()
    flat = buffers(opt)[0]
    assert flat.data.dtype == torch.float16 and flat.kahan is None and flat.master is None
    from dml_optim.core.quant import tensors_of

    state_bytes = sum(t.numel() * t.element_size() for s in flat.states.values() for t in tensors_of(s))
    assert state_bytes < 2.1 * 8192  # two 8-bit states and their block scales, not 8 bytes of FP32 states


def test_kahan_configurations_allocate_a_compensation_buffer_in_the_parameter_dtype():
    for name, dtype in (("fp16-kahan", torch.float16), ("bf16-kahan", torch.bfloat16)):
        config = P.CONFIGS[name]
        assert config.stored_state_dtype == torch.float32 and config.arithmetic_dtype == torch.float32
        opt = P.make_optimizer("adam", [torch.nn.Parameter(torch.ones(10, dtype=dtype))], config)
        opt.param_groups[0]["params"][0].grad = torch.full((10,), 1e-3, dtype=dtype)
        opt.step()
        flat = buffers(opt)[0]
        assert flat.kahan is not None and flat.kahan.dtype == dtype and flat.master is None
        assert all(s.dtype == torch.float32 for s in flat.states.values())
    fp16, compute = P.CONFIGS["fp16"], P.CONFIGS["fp16-fp32compute"]
    assert (fp16.stored_state_dtype, fp16.arithmetic_dtype) == (torch.float16, torch.float16)
    assert (compute.stored_state_dtype, compute.arithmetic_dtype) == (torch.float16, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_second_moment_is_the_state_that_accumulates_g_squared(name):
    # v = b * v + (1 - b) * g * g (Adam family, b the named decay) or sum += g * g (Adagrad):
    # one step from zero state with g = 2 and b = 0.5 leaves 2 (or 4) in the named state
    state, decay = P.second_moment(name)
    if name in ("momentum", "sgd", "lion"):  # (Lion's one state is a momentum: sign updates need no scale)
        assert (state, decay) == (None, None)
        return
    p = torch.nn.Parameter(torch.ones(3))
    opt = P.make_optimizer(name, [p], P.CONFIGS["fp32"], {decay: 0.5} if decay else None)
    p.grad = torch.full((3,), 2.0)
    opt.step()
    assert opt.state[p][state].tolist() == [2.0 if decay else 4.0] * 3


@pytest.mark.parametrize("name", NAMES)
def test_epsilon_name_is_what_keeps_a_zero_gradient_finite(name):
    # with zero gradient and zero state the update is 0 / (0 + epsilon): 0 with epsilon > 0, NaN with 0
    eps = P.epsilon_name(name)
    if name in ("momentum", "sgd", "lion"):
        assert eps is None
        return
    for value, finite in ((1e-8, True), (0.0, False)):
        p = torch.nn.Parameter(torch.ones(3))
        opt = P.make_optimizer(name, [p], P.CONFIGS["fp32"], {eps: value})
        p.grad = torch.zeros(3)
        opt.step()
        assert bool(torch.isfinite(p).all()) is finite, (name, eps, value)


def test_relative_error_curve_matches_its_definition():
    stream = _stream([0.5, -0.25, 0.125], [[0.3, -0.2, 0.1], [0.1, 0.1, 0.1]])
    res, _ = _run("adam", stream, ["bf16"])
    x = stream.params(torch.float64)
    ref = dml_optim.Adam(x)
    low = stream.params(torch.bfloat16)
    opt = dml_optim.Adam(low)
    for t in (1, 2):
        for p, q in ((x[0], low[0]),):
            p.grad = stream.grad(t).double()
            q.grad = stream.grad(t).bfloat16()
        ref.step()
        opt.step()
        expected = float(torch.linalg.vector_norm(low[0].detach().double() - x[0].detach()) / torch.linalg.vector_norm(x[0].detach()))
        assert res["bf16"].curve[t - 1] == pytest.approx(expected, rel=1e-12)


# -- precision modes -------------------------------------------------------------------------


def _fp16_run(name: str, numel: int, steps: int, **options):
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).half()) for n in (numel // 3, numel - numel // 3)]
    opt = P.make_optimizer(name, params, P.Config("x", torch.float16, **options))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).mul_(0.01).half()
        opt.step()
    flat = buffers(opt)[0]
    return flat, [flat.data.clone()] + [s.clone() for s in flat.states.values()]


@pytest.mark.parametrize("name", NAMES)
def test_chunked_fp32_compute_equals_unchunked_exactly(monkeypatch, name):
    numel = 5000
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", 1 << 30)
    _, whole = _fp16_run(name, numel, 4, compute_dtype=torch.float32)
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", 1000)
    flat, chunked = _fp16_run(name, numel, 4, compute_dtype=torch.float32)
    for a, b in zip(whole, chunked):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit-exact
    # the scratch memory stays at the cap although the model is 5x larger
    assert flat.numel == numel
    assert flat.scratch and all(s.numel() <= 1000 for s in flat.scratch)
    assert all(s.dtype == torch.float32 for s in flat.scratch)


def test_master_weights_equal_fp32_run_rounded_to_fp16():
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=gen).half() for n in (700, 300)]  # FP16-representable
    master = [torch.nn.Parameter(t.clone()) for t in init]
    fp32 = [torch.nn.Parameter(t.float()) for t in init]
    opt_m = dml_optim.Adam(master, lr=1e-2, master_weights=True)
    # like with like: master weights are a precision mode of the eager (and compiled) backends, so opt_m runs
    # the eager op chain on its FP32 master copy; a plain FP32 run would default to torch's fused kernel on the
    # CPU (dml_optim.backends.fused), which rounds differently by units in the last place.  The FP32 reference is
    # therefore the eager op chain too: the claim is that the master copy IS that run, bit for bit.
    opt_f = dml_optim.Adam(fp32, lr=1e-2, backend="eager")
    assert opt_m.resolved_backends() == opt_f.resolved_backends() == [["eager"]]
    for _ in range(10):
        grads = [torch.randn(t.shape, generator=gen).mul_(0.1).half() for t in init]  # FP16-representable
        for p, q, g in zip(master, fp32, grads):
            p.grad, q.grad = g.clone(), g.float()
        opt_m.step()
        opt_f.step()
    flat = buffers(opt_m)[0]
    assert torch.equal(flat.master, buffers(opt_f)[0].data)  # the FP32 master copy is the FP32 run
    for p, q in zip(master, fp32):
        assert p.dtype == torch.float16
        assert torch.equal(p.detach(), q.detach().half())  # FP16 params = FP32 run rounded to FP16
    saved = opt_m.state_dict()["state"][0]
    assert saved["master_param"].dtype == torch.float32 and torch.equal(saved["master_param"], fp32[0].detach())


def test_bfloat16_adam_on_cpu_follows_the_float64_reference():
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(64, generator=gen).bfloat16()
    p16 = torch.nn.Parameter(init.clone())
    p64 = torch.nn.Parameter(init.double())
    opt16, opt64 = dml_optim.Adam([p16], lr=1e-2), dml_optim.Adam([p64], lr=1e-2)
    for _ in range(5):
        g = torch.randn(64, generator=gen)
        p16.grad, p64.grad = g.bfloat16(), g.bfloat16().double()
        opt16.step()
        opt64.step()
    assert p16.dtype == torch.bfloat16 and torch.isfinite(p16).all()
    assert not torch.equal(p16.detach(), init)
    # observed max error 3.9e-3 (about 1 bfloat16 ULP at |x| ~ 1 after 5 steps): within TOL[bfloat16]
    torch.testing.assert_close(p16.detach().double(), p64.detach(), **TOL[torch.bfloat16])


def test_dml_adam_rejects_bfloat16_with_a_clear_error():
    with pytest.raises(TypeError, match="bfloat16.*FLOAT32 or FLOAT16"):
        dml_optim.DmlAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(TypeError, match="DmlAdam"):
        dml_optim.DmlAdam([torch.nn.Parameter(torch.zeros(3))], state_dtype=torch.bfloat16)


def test_harness_skips_bf16_for_dml_adam_with_the_reason():
    res, skipped = _run("dml-adam", _stream([0.5], [[0.1]]), ["fp32", "bf16"])
    assert list(res) == ["fp32"]
    assert skipped[0]["config"] == "bf16" and "FLOAT32 or FLOAT16" in skipped[0]["reason"]
