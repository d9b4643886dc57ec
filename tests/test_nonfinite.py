"""Non-finite gradients (issue 8, item 3): ``nonfinite="propagate" | "skip" | "raise"``.

* ``propagate`` (default) behaves like torch.optim: an inf/NaN gradient turns
  into NaN/inf parameters and states in the same places (compared with
  torch.optim in float64 through the DESIGN §2 equivalences).
* ``skip``: a step with any non-finite gradient leaves parameters, states and
  step counters bit-exactly unchanged (one flag per step: every "skip" buffer
  skips together), the next finite step continues exactly as a run that never
  saw the bad step, and no host sync happens (``aten::_local_scalar_dense``
  calls counted with a TorchDispatchMode).
* ``raise``: FloatingPointError naming the offending parameter(s), nothing
  changed; it costs host syncs (counted: one per flat buffer).

All three with None-grad parameters mixed in, several groups, and in chunked
precision mode (float16 storage, float32 compute).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dml_optim.optimizers.engine as engine
from dml_optim import Adagrad, Adam, DmlAdam, Momentum
from test_bad_inputs import assert_same, snapshot
from introspect import buffers, runs_in_chunks

ALL = (Adam, Adagrad, Momentum, DmlAdam)
INF, NAN = float("inf"), float("nan")


class HostSyncCounter(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``): host syncs."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_host_sync_counter_counts():
    with HostSyncCounter() as c:
        t = torch.ones(3)
        t.sum().item()
        bool(t.max() > 0)
    assert c.syncs == 2


# -- a small scripted run ----------------------------------------------------------

SHAPES = ((3, 2), (5,), (4,))


def init_params(dtype=torch.float64):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


def grad_stream(n, dtype=torch.float64, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES] for _ in range(n)]


def with_bad(grads, which=2, value=INF, index=1):
    """A copy of one step's gradients with ``grads[which].view(-1)[index] = value``."""
    out = [None if g is None else g.clone() for g in grads]
    out[which].view(-1)[index] = value
    return out


def drop(grads, which):
    out = list(grads)
    out[which] = None
    return out


def kwargs_for(cls):
    """Hyperparameters with a DESIGN §2 torch.optim equivalent (epsilon 0 for the Adams)."""
    return {Adam: dict(lr=0.01, epsilon=0.0), DmlAdam: dict(lr=0.01, epsilon=0.0),
            Adagrad: dict(lr=0.1), Momentum: dict(lr=0.05, alpha=0.9, beta=1.0)}[cls]


def torch_equivalent(cls, params):
    return {
        Adam: lambda: torch.optim.Adam(params, lr=0.01, eps=0.0, foreach=False),
        DmlAdam: lambda: torch.optim.Adam(params, lr=0.01, eps=0.0, foreach=False),
        Adagrad: lambda: torch.optim.Adagrad(params, lr=0.1, foreach=False),
        Momentum: lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False),
    }[cls]()


def build(cls, dtype=torch.float64, groups=False, **kw):
    ps = [torch.nn.Parameter(x) for x in init_params(dtype)]
    spec = [{"params": ps[:2]}, {"params": ps[2:]}] if groups else ps
    return ps, cls(spec, **kwargs_for(cls), **kw)


def feed(ps, opt, grads):
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()
    opt.step()


def dtype_for(cls):
    return torch.float32 if cls is DmlAdam else torch.float64  # DmlAdam has no float64


# -- propagate ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_propagate_matches_torch_optim(cls, bad):
    dtype = dtype_for(cls)
    stream = grad_stream(3, dtype)
    stream[1] = with_bad(stream[1], which=1, value=bad, index=2)
    ps, opt = build(cls, dtype)
    ref = [torch.nn.Parameter(x) for x in init_params(dtype)]
    topt = torch_equivalent(cls, ref)
    for grads in stream:
        feed(ps, opt, grads)
        feed(ref, topt, grads)
        for p, r in zip(ps, ref):
            assert torch.equal(torch.isnan(p), torch.isnan(r)) and torch.equal(torch.isinf(p), torch.isinf(r))
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5 if dtype == torch.float32 else 1e-10,
                                       atol=1e-6 if dtype == torch.float32 else 1e-12, equal_nan=True)
    assert not torch.isfinite(ps[1]).all()  # the bad gradient did reach the parameter
    assert torch.isfinite(ps[0]).all() and torch.isfinite(ps[2]).all()  # and nothing else


# -- skip ------------------------------------------------------------------------------


def _world_state(ps, opt):
    s = snapshot(ps, opt)
    del s["grads"], s["group_params"]  # grads are zeroed on a skipped step (documented); ids differ between runs
    return s


SKIP_SCENARIOS = {
    # name: (list of step gradients for the run WITH the bad step, index of the bad step)
    "all-grads": lambda s: ([s[0], with_bad(s[1]), s[2], s[3]], 1),
    "nan": lambda s: ([s[0], with_bad(s[1], which=0, value=NAN), s[2], s[3]], 1),
    "first-step-bad": lambda s: ([with_bad(s[0]), s[1], s[2], s[3]], 0),
    "none-grads-mixed": lambda s: ([drop(s[0], 1), with_bad(drop(s[1], 0), which=2), drop(s[2], 0), s[3]], 1),
    "two-bad-in-a-row": lambda s: ([s[0], with_bad(s[1]), with_bad(s[1], which=0, value=-INF), s[2], s[3]], 1),
}


def _skip_params():
    return [pytest.param(cls, scenario, id=f"{cls.__name__}-{scenario}")
            for cls in ALL for scenario in sorted(SKIP_SCENARIOS)]


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("cls,scenario", _skip_params())
def test_skip_leaves_everything_and_continues_as_if_never_seen(cls, scenario, groups):
    dtype = dtype_for(cls)
    stream = grad_stream(4, dtype)
    with_bad_steps, first_bad = SKIP_SCENARIOS[scenario](stream)
    bad = [i for i, gs in enumerate(with_bad_steps)
           if any(g is not None and not torch.isfinite(g).all() for g in gs)]
    clean = [gs for i, gs in enumerate(with_bad_steps) if i not in bad]

    ps, opt = build(cls, dtype, groups=groups, nonfinite="skip")
    for i, grads in enumerate(with_bad_steps):
        before = _world_state(ps, opt)
        with HostSyncCounter() as counter:
            feed(ps, opt, grads)
        assert counter.syncs == 0, f"step {i}: {counter.syncs} host syncs"
        if i in bad:
            assert_same(before, _world_state(ps, opt))

    ref_ps, ref = build(cls, dtype, groups=groups, nonfinite="skip")
    for grads in clean:
        feed(ref_ps, ref, grads)
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))

    # and the finite part agrees with torch.optim (which never saw the bad steps)
    tps = [torch.nn.Parameter(x) for x in init_params(dtype)]
    topt = torch_equivalent(cls, tps)
    for grads in clean:
        feed(tps, topt, grads)
    for p, t in zip(ps, tps):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-5 if dtype == torch.float32 else 1e-10,
                                   atol=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("cls,kw", [
    pytest.param(Adam, dict(epsilon=0.0), id="Adam-eps0"),
    pytest.param(DmlAdam, dict(epsilon=0.0), id="DmlAdam-eps0"),
    pytest.param(Adagrad, dict(epsilon=0.0), id="Adagrad-eps0"),
    pytest.param(Adam, dict(epsilon=1e-8), id="Adam-eps1e-8"),
    pytest.param(DmlAdam, dict(epsilon=1e-8), id="DmlAdam-eps1e-8"),
    pytest.param(Adagrad, dict(epsilon=1e-10), id="Adagrad-eps1e-10"),
    pytest.param(Momentum, {}, id="Momentum"),
])
def test_skipped_first_step_with_zero_second_moment(cls, kw):
    """A skipped first step (zero second moment) is exact even with epsilon 0: no 0 * (0/0) = NaN.

    (Found by this file: skip_identity now gates epsilon to 1 on a skipped step.)
    """
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1, nonfinite="skip", **kw)
    p.grad = torch.tensor([1.0, INF, 1.0])
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def test_skip_is_one_decision_for_every_skip_buffer():
    """An inf in group 1 skips group 0's update too (a step is skipped as a whole)."""
    ps, opt = build(Adam, groups=True, nonfinite="skip")
    feed(ps, opt, grad_stream(1)[0])
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(grad_stream(1, seed=9)[0], which=2))
    assert_same(before, _world_state(ps, opt))


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_skip_in_chunked_precision_mode(cls, monkeypatch):
    """float16 storage, float32 compute over 4-element chunks; the inf sits in the last chunk."""
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", 4)
    stream = grad_stream(4, torch.float16)
    bad_stream = [stream[0], with_bad(stream[1], which=2, index=3), stream[2], stream[3]]
    kw = dict(nonfinite="skip", compute_dtype=torch.float32, state_dtype=torch.float32)
    ps, opt = build(cls, torch.float16, **kw)
    for i, grads in enumerate(bad_stream):
        before = _world_state(ps, opt)
        with HostSyncCounter() as counter:
            feed(ps, opt, grads)
        assert counter.syncs == 0
        if i == 1:
            assert_same(before, _world_state(ps, opt))
    assert runs_in_chunks(opt)
    ref_ps, ref = build(cls, torch.float16, **kw)
    for grads in (stream[0], stream[2], stream[3]):
        feed(ref_ps, ref, grads)
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))


def test_skip_with_master_weights():
    stream = grad_stream(3, torch.float16)
    ps, opt = build(Adam, torch.float16, nonfinite="skip", master_weights=True)
    feed(ps, opt, stream[0])
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(stream[1], which=0, value=NAN))
    assert_same(before, _world_state(ps, opt))
    feed(ps, opt, stream[2])
    ref_ps, ref = build(Adam, torch.float16, nonfinite="skip", master_weights=True)
    feed(ref_ps, ref, stream[0])
    feed(ref_ps, ref, stream[2])
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))


def test_skipped_step_is_not_counted_in_state_dict():
    ps, opt = build(Adam, nonfinite="skip")
    stream = grad_stream(2)
    feed(ps, opt, stream[0])
    feed(ps, opt, with_bad(stream[1]))
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [1.0, 1.0, 1.0]


# -- raise -----------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_raise_names_the_parameters_and_changes_nothing(cls, groups):
    dtype = dtype_for(cls)
    stream = grad_stream(2, dtype)
    ps, opt = build(cls, dtype, groups=groups, nonfinite="raise")
    feed(ps, opt, stream[0])
    grads = with_bad(with_bad(drop(stream[1], 0), which=1, value=NAN), which=2, value=-INF)
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()
    before = snapshot(ps, opt)
    with pytest.raises(FloatingPointError) as info:
        opt.step()
    assert_same(before, snapshot(ps, opt))
    msg = str(info.value)
    g1 = "param_groups[0]['params'][1]"
    g2 = "param_groups[1]['params'][0]" if groups else "param_groups[0]['params'][2]"
    assert g1 in msg and "nothing was updated" in msg
    assert "param_groups[0]['params'][0]" not in msg  # its grad is None: not named
    if not groups:  # one buffer: both offenders are named in one message
        assert g2 in msg


def test_raise_costs_one_host_sync_per_step_and_propagate_none():
    ps, opt = build(Adam, nonfinite="raise")
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 1
    ps, opt = build(Adam, groups=True, nonfinite="raise")
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 1  # one per step, whatever the number of flat buffers
    ps, opt = build(Adam)
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 0


def test_raise_in_chunked_mode(monkeypatch):
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", 4)
    stream = grad_stream(2, torch.float16)
    ps, opt = build(Adam, torch.float16, nonfinite="raise", compute_dtype=torch.float32)
    feed(ps, opt, stream[0])
    grads = with_bad(stream[1], which=2, index=3)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    before = snapshot(ps, opt)
    with pytest.raises(FloatingPointError, match=r"param_groups\[0\]\['params'\]\[2\]"):
        opt.step()
    assert_same(before, snapshot(ps, opt))


def test_float16_overflow_to_inf_is_caught_by_skip():
    """A finite float32 value that overflows float16 (7e4 > 65504) is what 'skip' exists for."""
    g = torch.tensor([7e4]).to(torch.float16)
    assert math.isinf(float(g))
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    opt = Adam([p], nonfinite="skip", epsilon=1e-4)
    p.grad = g
    opt.step()
    assert float(p.detach()) == 1.0
