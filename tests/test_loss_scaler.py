"""Loss scaling on the device: DynamicLossScaler and the torch.amp.GradScaler protocol (issue 6).

The growth/backoff rule is checked against a literal re-statement of
``torch._amp_update_scale_``'s rule (``_simulate``), the skip against runs
that never saw the overflow step, and the GradScaler path against
DynamicLossScaler step by step.  Scales are powers of two, so scaling and
unscaling are exact and runs can be compared bit for bit.

The optimizers come from the test matrix (``tests/matrix.py``: each one's
default variant, on each device); the dtype axis here is the loss-scaling one
(float32 and float16 parameters).
"""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest
import torch

import dml_optim
from dml_optim.training.amp import DynamicLossScaler
from matrix import Case, case_of, classes

needs_cpu_gradscaler = pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler (with device 'cpu') needs torch >= 2.3"
)

ADAM = case_of("adam")


def _build(case: Case, params):
    """The case's optimizer (its default-variant hyperparameters) with lr 1e-2 and, where the rule has
    one, epsilon 1e-4 (representable in float16)."""
    return case.build(params, lr=1e-2, **case.epsilon_kwargs(1e-4))


def _simulate(flags, init, growth, backoff, interval):
    """``torch._amp_update_scale_``'s rule, by hand, in float32 like the device tensor."""
    scale, tracker, out = np.float32(init), 0, []
    for found in flags:
        if found:
            scale, tracker = np.float32(scale * np.float32(backoff)), 0
        else:
            tracker += 1
            if tracker == interval:
                with np.errstate(over="ignore"):
                    grown = np.float32(scale * np.float32(growth))
                if np.isfinite(grown):
                    scale = grown
                tracker = 0
        out.append((float(scale), tracker))
    return out


def _problem(dtype=torch.float32, case: Case = ADAM, n=(6, 3)):
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(k, generator=gen).to(dtype=dtype, device=case.device)) for k in n]
    xs = [[torch.randn(k, generator=gen).to(dtype=dtype, device=case.device) for k in n] for _ in range(12)]
    return params, _build(case, params), xs


def _loss(params, x, overflow=False):
    loss = sum((p * xi).sum() for p, xi in zip(params, x))
    return loss * math.inf if overflow else loss


def _snapshot(opt):
    (flat,) = opt.flat_buffers()
    return [flat.data.clone(), torch.tensor(flat.step_counts)] + [s.clone() for s in flat.states.values()]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x, y.view(torch.uint8) if y.is_floating_point() else y)


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(init_scale=0.0), ValueError, r"^init_scale must be > 0, got 0\.0"),
    (dict(init_scale=math.inf), ValueError, r"^init_scale must be finite, got inf"),
    (dict(init_scale="big"), TypeError, r"^init_scale must be a real number, got 'big'"),
    (dict(growth_factor=1.0), ValueError, r"^growth_factor must be > 1, got 1\.0"),
    (dict(growth_factor="2"), TypeError, r"^growth_factor must be a real number"),
    (dict(backoff_factor=1.0), ValueError, r"^backoff_factor must be in \(0, 1\), got 1\.0"),
    (dict(backoff_factor=0.0), ValueError, r"^backoff_factor must be in \(0, 1\), got 0\.0"),
    (dict(backoff_factor=None), TypeError, r"^backoff_factor must be a real number"),
    (dict(growth_interval=0), ValueError, r"^growth_interval must be >= 1, got 0"),
    (dict(growth_interval=2.5), TypeError, r"^growth_interval must be an int, got 2\.5"),
    (dict(growth_interval=True), TypeError, r"^growth_interval must be an int, got True"),
])
def test_bad_arguments_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DynamicLossScaler(**kwargs)


def test_scale_takes_a_tensor_or_a_list_or_tuple_of_them():
    scaler = DynamicLossScaler(init_scale=4.0)
    a, b = torch.tensor(1.0), torch.tensor([2.0, 3.0])
    as_list, as_tuple = scaler.scale([a, b]), scaler.scale((a, (b,)))
    assert type(as_list) is list and type(as_tuple) is tuple and type(as_tuple[1]) is tuple
    assert torch.equal(as_list[0], torch.tensor(4.0)) and torch.equal(as_list[1], torch.tensor([8.0, 12.0]))
    assert torch.equal(as_tuple[1][0], torch.tensor([8.0, 12.0]))
    with pytest.raises(TypeError, match="outputs must be a Tensor or a list/tuple of Tensors, got dict"):
        scaler.scale({"loss": a})


def test_protocol_errors():
    params, opt, xs = _problem()
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="before scale"):
        scaler.step(opt)
    with pytest.raises(TypeError, match="dml_optim optimizer"):
        scaler.step(torch.optim.SGD(params, lr=0.1))
    scaler.scale(_loss(params, xs[0])).backward()
    with pytest.raises(RuntimeError, match="before any step"):
        scaler.update()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.step(opt)
    scaler.update()


# -- skipping ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", classes())
def test_overflow_step_is_skipped_bit_exactly(case, dtype):
    overflow_at = 3
    runs = {}
    for with_overflow in (True, False):
        params, opt, xs = _problem(dtype, case)
        scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=1000)
        snaps, found = [], []
        for i, x in enumerate(xs[:6]):
            if i == overflow_at and not with_overflow:
                continue
            opt.zero_grad()
            scaler.scale(_loss(params, x, overflow=with_overflow and i == overflow_at)).backward()
            found.append(float(scaler.step(opt)))
            if with_overflow and i == overflow_at:
                assert scaler.get_scale() == 2.0**8
                _same(_snapshot(opt), snaps[-1])  # params, step counters, states: untouched
            scaler.update(new_scale=2.0**8)  # same scale in both runs, so the clean steps match
            snaps.append(_snapshot(opt))
        runs[with_overflow] = (snaps, found)
    (with_snaps, with_found), (without_snaps, without_found) = runs[True], runs[False]
    assert with_found == [0, 0, 0, 1, 0, 0] and without_found == [0] * 5
    del with_snaps[overflow_at]
    for a, b in zip(with_snaps, without_snaps):  # the skipped step changed nothing at all
        _same(a, b)
    assert torch.isfinite(with_snaps[-1][0].float()).all()


def test_skipped_first_fp16_step_with_default_dml_adam_epsilon_keeps_params():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = dml_optim.DmlAdam([p])  # epsilon 1e-8: 0 in FP16 arithmetic
    scaler = DynamicLossScaler()
    scaler.scale((p * math.inf).sum()).backward()  # the very first step overflows
    assert float(scaler.step(opt)) == 1.0
    assert torch.equal(p.detach(), torch.ones(4, dtype=torch.float16))


@pytest.mark.parametrize("overflowing", ["first", "last"])
def test_found_inf_counts_every_optimizer_of_the_iteration(overflowing):
    """Whichever optimizer overflows, and whichever steps first, the iteration's update backs off
    (the scaler keeps every optimizer's verdict, not only the last one's)."""
    params, opt, xs = _problem()
    params2 = [torch.nn.Parameter(torch.ones(4))]
    opt2 = dml_optim.Adam(params2)
    scaler = DynamicLossScaler(init_scale=4.0)
    loss = _loss(params, xs[0]) + (params2[0] * math.inf).sum()
    scaler.scale(loss).backward()
    order = [(opt2, 1.0), (opt, 0.0)] if overflowing == "first" else [(opt, 0.0), (opt2, 1.0)]
    for o, found in order:
        assert float(scaler.step(o)) == found
    scaler.update()
    assert scaler.get_scale() == 2.0  # one overflow in the iteration: back off once
    assert torch.equal(params2[0].detach(), torch.ones(4))
    # the next iteration is clean on both: no backoff, the tracker counts it
    for o in (opt, opt2):
        o.zero_grad()
    scaler.scale(_loss(params, xs[1]) + params2[0].sum()).backward()
    assert [float(scaler.step(o)) for o, _ in order] == [0.0, 0.0]
    scaler.update()
    assert scaler.state_dict()["scale"] == 2.0 and scaler.state_dict()["_growth_tracker"] == 1


# -- the growth/backoff rule -------------------------------------------------------------


def test_scale_follows_the_growth_backoff_rule():
    flags = [0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    init, growth, backoff, interval = 2.0**10, 4.0, 0.25, 3
    expected = _simulate(flags, init, growth, backoff, interval)
    params, opt, xs = _problem()
    scaler = DynamicLossScaler(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    for i, flag in enumerate(flags):
        opt.zero_grad()
        scaler.scale(_loss(params, xs[i % len(xs)], overflow=bool(flag))).backward()
        scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        assert (state["scale"], state["_growth_tracker"]) == expected[i], f"after step {i}"
    assert [s for s, _ in expected][:7] == [init, init, init * 4, init, init, init, init / 4]  # the rule, spelled out


def test_growth_never_reaches_inf():
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    params, opt, xs = _problem()
    scaler.scale(_loss(params, xs[0])).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**127  # 2**128 is inf in float32: the scale is kept
    assert _simulate([0], 2.0**127, 2.0, 0.5, 1) == [(2.0**127, 0)]


def test_state_dict_round_trip_and_update_new_scale():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=5)
    params, opt, xs = _problem()
    for x in xs[:2]:
        opt.zero_grad()
        scaler.scale(_loss(params, x)).backward()
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    assert state == {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 2}
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(KeyError, match="_growth_tracker"):
        other.load_state_dict({k: v for k, v in state.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="growth_factor"):
        other.load_state_dict({**state, "growth_factor": 0.5})
    for tracker in (-1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=r"_growth_tracker must be an int >= 0"):
            other.load_state_dict({**state, "_growth_tracker": tracker})
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        other.load_state_dict([("scale", 8.0)])
    assert other.state_dict() == state  # a rejected state dict changed nothing
    scaler.update(new_scale=3.0)  # update() without a step is fine when a new scale is given
    assert scaler.get_scale() == 3.0


@pytest.mark.parametrize("value, exc, match", [
    (-1.0, ValueError, r"new_scale must be > 0, got -1\.0"),
    ("big", TypeError, r"new_scale must be a real number, got 'big'"),
    (torch.ones(2), ValueError, r"new_scale must be a 1-element tensor, got shape \(2,\)"),
])
def test_update_new_scale_is_validated_and_refusals_change_nothing(value, exc, match):
    scaler = DynamicLossScaler(init_scale=8.0)
    params, opt, xs = _problem()
    scaler.scale(_loss(params, xs[0])).backward()
    scaler.step(opt)
    with pytest.raises(exc, match=match):
        scaler.update(new_scale=value)
    assert scaler.get_scale() == 8.0


def test_update_new_scale_as_a_one_element_tensor():
    """``new_scale`` may be a 1-element tensor of any shape (GradScaler's protocol); the scale stays 0-d."""
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=torch.tensor([[4.0]]))
    assert scaler.get_scale() == 4.0
    assert scaler.scale(torch.tensor(1.0)).shape == ()  # a (1, 1) scale would broadcast the loss to (1, 1)


@needs_cpu_gradscaler
def test_state_dict_moves_between_gradscaler_and_dynamic_loss_scaler():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    ours = DynamicLossScaler()
    ours.load_state_dict(torch_scaler.state_dict())
    assert ours.get_scale() == 32.0 and ours.state_dict()["growth_interval"] == 7
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == 32.0 and back.get_growth_interval() == 7


# -- torch.amp.GradScaler -------------------------------------------------------------------


@needs_cpu_gradscaler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradscaler_steps_without_any_warning(dtype):
    """torch's deprecated step(grad_scaler=...) protocol is not used: no FutureWarning, ever."""
    params, opt, xs = _problem(dtype)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in xs[:3]:
            opt.zero_grad()
            scaler.scale(_loss(params, x)).backward()
            scaler.step(opt)
            scaler.update()
    assert "grad_scaler" not in inspect.signature(opt.step).parameters


@needs_cpu_gradscaler
def test_in_step_unscaling_is_advertised_only_for_low_precision_gradients():
    """GradScaler refuses to unscale FP16 gradients itself: only then does our step do it
    (grad_scale/found_inf protocol); FP32 keeps GradScaler's own path, which frameworks
    (Lightning's mixed precision with clipping) require."""
    _, fp32, _ = _problem(torch.float32)
    _, fp16, _ = _problem(torch.float16)
    assert fp32._step_supports_amp_scaling is False
    assert fp16._step_supports_amp_scaling is True


@needs_cpu_gradscaler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_gradscaler_loop_matches_dynamic_loss_scaler(dtype, unscale_first):
    if unscale_first and dtype == torch.float16:
        pytest.skip("GradScaler.unscale_ itself refuses FP16 gradients ('Attempting to unscale FP16 gradients')")
    flags = [0, 0, 1, 0, 0, 0, 1, 0]
    pa, oa, xs = _problem(dtype)
    pb, ob, _ = _problem(dtype)
    ta = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    tb = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
    for i, flag in enumerate(flags):
        oa.zero_grad()
        ob.zero_grad()
        ta.scale(_loss(pa, xs[i], overflow=bool(flag))).backward()
        tb.scale(_loss(pb, xs[i], overflow=bool(flag))).backward()
        if unscale_first:
            ta.unscale_(oa)  # grads unscaled by torch; our step must not unscale again
        ta.step(oa)
        tb.step(ob)
        ta.update()
        tb.update()
        assert ta.get_scale() == tb.get_scale(), f"step {i}"
        if dtype == torch.float16:  # both unscale and skip in our step: bit-identical
            _same(_snapshot(oa), _snapshot(ob))
        else:  # GradScaler's own path: a plain step (bias corrections on the host, in float64)
            a, b = _snapshot(oa), _snapshot(ob)
            assert torch.equal(a[1], b[1])  # the same steps were skipped
            for x, y in zip(a[:1] + a[2:], b[:1] + b[2:]):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)  # observed: 1 ulp
    assert ta.get_scale() == _simulate(flags, 2.0**8, 2.0, 0.5, 2)[-1][0]


# -- audit: no host sync, no fallback ----------------------------------------------------------


def _audit(opt, run):
    """Audit ``run()`` as if it were ``opt.step()``."""
    from dml_optim.audit import audit_call

    return audit_call(opt, run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scaled_step_and_update_audit_shows_no_sync_and_no_fallback(dtype):
    params, opt, xs = _problem(dtype)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=1)
    for overflow in (False, True, False):  # first, skipped and later steps (device counters)
        opt.zero_grad()
        scaler.scale(_loss(params, xs[0], overflow=overflow)).backward()
        report = _audit(opt, lambda: (scaler.step(opt), scaler.update()))
        assert report.host_syncs == 0, report.ops
        assert report.fallbacks == [], report.fallbacks
        assert report.total_ops > 0


@needs_cpu_gradscaler
def test_gradscaler_on_directml_falls_back_only_in_its_own_helpers():
    """Our part of a GradScaler step is native; GradScaler's own inf check and update have no
    DirectML kernel (the documented reason to use DynamicLossScaler there)."""
    params, opt, xs = _problem(torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(params, xs[0])).backward()
    report = _audit(opt, lambda: scaler.step(opt))
    assert [op for op, _ in report.fallbacks] == ["aten::_amp_foreach_non_finite_check_and_unscale_"]
    assert report.host_syncs == 0
    report = _audit(opt, scaler.update)
    assert [op for op, _ in report.fallbacks] == ["aten::_amp_update_scale_"]


def test_unscale_then_clip_then_step_matches_step_without_clipping_when_clip_is_loose():
    """DynamicLossScaler.unscale_() unscales on the device once; step() then neither
    unscales nor checks again (a loose clip changes nothing: same result as no unscale_)."""
    results = []
    for clip in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8))
        opt = dml_optim.Adam([p], lr=0.1)
        scaler = DynamicLossScaler(init_scale=1024.0)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale((p * p).sum()).backward()
            if clip:
                found = scaler.unscale_(opt)
                assert float(found) == 0.0
                torch.nn.utils.clip_grad_norm_([p], max_norm=1e6)
            scaler.step(opt)
            scaler.update()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_unscale_needs_a_dml_optim_optimizer():
    """Both hooks are needed: ``unscale_`` now and ``step_scaled`` at the step (an object with only
    the first is refused before anything is unscaled)."""

    class OnlyUnscale:
        def __init__(self):
            self.calls = 0

        def unscale_(self, inv_scale):
            self.calls += 1

    scaler = DynamicLossScaler()
    scaler.scale(torch.ones(()))
    half = OnlyUnscale()
    for optimizer in (half, torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)):
        with pytest.raises(TypeError, match=r"unscale_: optimizer must be a dml_optim optimizer, got (OnlyUnscale|SGD)"):
            scaler.unscale_(optimizer)
    assert half.calls == 0


def test_unscale_twice_is_refused():
    p = torch.nn.Parameter(torch.ones(2))
    opt = dml_optim.Adam([p])
    scaler = DynamicLossScaler()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
