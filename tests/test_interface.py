"""The one backend interface (dml_optim/backends/base.py) and what the public introspection shows of it.

* every backend (eager, compiled, fused) answers ``supports``, ``plan`` and ``run``, and a plan made and run
  through the interface equals the optimizer's own step;
* a buffer's backend is decided once per change of its group's structural settings (``BufferInfo.decisions``),
  not per step, and not when a scheduler changes ``lr``;
* a scheduler changing ``lr`` every step gives torch.optim's parameters step for step, and every step after the
  first ones repeats the last (``BufferInfo.repeated``), on every backend.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch

import dml_optim
from dml_optim.backends.base import Backend, FusedPlan, Plan, StepRequest
from dml_optim.backends.choose import BACKEND_OF, decide, plan_step, run_plan
from dml_optim.backends.compiled import compile_available

from introspect import buffers

COMPILE_OK, COMPILE_WHY = compile_available("cpu")
BACKENDS = ["eager", pytest.param("compiled", marks=pytest.mark.skipif(not COMPILE_OK, reason=COMPILE_WHY)), "fused"]
#: whole 64-byte units per parameter: torch's fused kernel over our flat buffer equals its own over the tensors
SHAPES = [(8, 4), (64,), (2, 16)]


def _params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]


@pytest.mark.parametrize("name", ["eager", "compiled", "fused"])
def test_every_backend_implements_the_interface(name):
    backend = BACKEND_OF[name]
    assert isinstance(backend, Backend) or all(callable(getattr(backend, m)) for m in ("supports", "plan", "run"))
    assert backend.name == name
    p = torch.nn.Parameter(torch.randn(8))
    opt = dml_optim.AdamW([p], lr=1e-3)
    flat = opt.buffers_by_group()[0][1][0]
    reason = backend.supports(opt.rule, opt.param_groups[0], flat)
    if name == "eager":
        assert reason is None
    elif name == "fused":
        assert reason is None
        opt.param_groups[0]["nonfinite"] = "skip"
        assert "nonfinite" in backend.supports(opt.rule, opt.param_groups[0], flat)
    else:
        assert (reason is None) is COMPILE_OK


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_made_and_run_through_the_interface_is_the_optimizers_step(backend):
    """``plan_step`` then ``run_plan`` (what a step runs per buffer, the entry point for stepping a buffer at
    another time) give exactly the optimizer's own step."""
    ours, twin = _params(), _params()
    a = dml_optim.AdamW(ours, lr=1e-2, backend=backend)
    b = dml_optim.AdamW(twin, lr=1e-2, backend=backend)
    for p, q, g in zip(ours, twin, _grads(0)):
        p.grad, q.grad = g.clone(), g.clone()
    a.step()
    b.step()
    for p, q, g in zip(ours, twin, _grads(1)):
        p.grad.copy_(g)
        q.grad.copy_(g)
    a.step()
    (request,) = b.step_requests()  # (the layout's work: bindings checked, states allocated)
    plan = plan_step(request)
    assert isinstance(plan, Plan) and plan.backend == backend and plan.request.flat is request.flat
    run_plan(plan)
    request.flat.counter.advance(False)
    for p, q in zip(ours, twin):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_backend_is_decided_once_per_structural_change():
    """A scheduler's new lr, a new weight decay (not zero): no new decision; a structural setting (``maximize``),
    a float becoming exactly zero (it removes ops): one each."""
    ps = _params()
    opt = dml_optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    for step in range(6):
        for p, g in zip(ps, _grads(step)):
            p.grad = g
        opt.step()
        sched.step()
    assert buffers(opt)[0].decisions == 1
    opt.param_groups[0]["weight_decay"] = 0.02
    opt.step()
    assert buffers(opt)[0].decisions == 1
    opt.param_groups[0]["maximize"] = True
    opt.step()
    assert buffers(opt)[0].decisions == 2
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    opt.step()
    assert buffers(opt)[0].decisions == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_lr_written_in_place_or_a_loaded_lr_makes_no_new_decision(backend):
    """Two more ways a new ``lr`` reaches a step, neither a structural change: a tensor ``lr`` written in place
    (``lr.fill_(x)``: a scheduler over a tensor lr) and a state dict loaded with another ``lr``.  Neither may
    make a new backend decision (on ``auto`` that is a new compiled kernel or a lost fused path; only
    ``decisions`` shows it), and the parameters follow torch.optim's with the same tensor lr, step for step."""
    ours, theirs = _params(), _params()
    lr, lr_twin = torch.tensor(1e-2), torch.tensor(1e-2)
    opt = dml_optim.AdamW(ours, lr=lr, weight_decay=0.05, backend=backend)
    twin = torch.optim.AdamW(theirs, lr=lr_twin, weight_decay=0.05, foreach=False)

    def step(k):
        for o, ps in ((opt, ours), (twin, theirs)):
            for p, g in zip(ps, _grads(k)):
                p.grad = g.clone()
            o.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, msg=f"step {k}")

    for k in range(6):
        step(k)
        for t in (lr, lr_twin):
            t.fill_(1e-2 / (2.0 + k))
    assert buffers(opt)[0].decisions == 1
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 3e-3
    opt.load_state_dict(state)
    twin.param_groups[0]["lr"] = torch.tensor(3e-3)
    for k in range(6, 9):
        step(k)
    assert buffers(opt)[0].decisions == 1
    assert buffers(opt)[0].backend == backend


def _torch_twin(params, backend: str):
    if backend == "fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, fused=True)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, foreach=False)


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scheduler_changing_lr_every_step_equals_torch_and_repeats(backend, set_to_none):
    ours, theirs = _params(), _params()
    opt = dml_optim.AdamW(ours, lr=1e-2, weight_decay=0.05, backend=backend)
    twin = _torch_twin(theirs, backend)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)) for o in (opt, twin)]
    repeated = []
    for step in range(12):
        for o, ps in ((opt, ours), (twin, theirs)):
            o.zero_grad(set_to_none=set_to_none)
            for p, g in zip(ps, _grads(step)):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
            o.step()
        for s in scheds:
            s.step()
        repeated.append(all(info.repeated for info in buffers(opt)))
        for p, q in zip(ours, theirs):
            if backend == "fused":
                torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"step {step}")
            else:
                torch.testing.assert_close(p, q, msg=f"step {step}")
        assert opt.param_groups[0]["lr"] == twin.param_groups[0]["lr"]
    assert all(repeated[3:]), repeated  # (after the first steps, which bind the gradients: every step repeats)
    assert buffers(opt)[0].decisions == 1
    assert buffers(opt)[0].backend == backend


def _eager_events(opt, ps, step):
    """One step of a loop on DirectML's path with something changing now and then (see the caller)."""
    group = opt.param_groups[0]
    if 5 <= step < 9:
        group["lr"] = 1e-2 / (1.0 + step)  # a scheduler
    if step == 18:
        opt.load_state_dict(opt.state_dict())  # new state tensors
    if step == 22:
        ps[1].data = ps[1].detach().clone()  # re-bound parameter values
    if step == 26:
        group["amsgrad"] = True  # a new state, a new structure
    if step == 30:
        group["weight_decay"] = 0.0  # an exact zero: a new structure
    opt.zero_grad(set_to_none=step in (10, 32))
    for i, p in enumerate(ps):
        g = torch.sin((i + 1) * (step + 1) * torch.linspace(0, 1, p.numel())).view_as(p)
        if step in (32, 33) and i == 2:
            continue  # no gradient: two classes (and two counts from then on), the general path
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)
    del g  # (a gradient the caller still holds at the step stays the caller's, copied in: not this loop's case)
    opt.step()


@pytest.mark.parametrize("checks", ["full", "refs", "fast"])
def test_the_eager_steady_call_equals_a_step_planned_from_scratch_under_every_change(checks):
    """DirectML's path: a repeat of a one-class step calls the rule on the tensors it bound once
    (``EagerPlan.steady``), bit for bit what an optimizer that never repeats does, through a scheduler's lr,
    fresh and ``None`` gradients, a reload (new state tensors, bound again), re-bound values and new
    structures."""
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(s, generator=gen) for s in [(5, 4), (16,), (3,)]]
    params = [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(2)]
    opts = [dml_optim.AdamW(ps, lr=1e-2, weight_decay=0.1, backend="eager", checks=checks) for ps in params]
    opts[1].repeat = False  # (plans every step from scratch)
    repeated, steady = [], []
    for step in range(36):
        for opt, ps in zip(opts, params):
            _eager_events(opt, ps, step)
        for p, q in zip(*params):
            assert torch.equal(p, q), f"step {step}"
        info = buffers(opts[0])[0]
        call = info.bound
        if call is not None:  # (bound to the buffer's tensors of this step)
            assert call[0] is info.data and call[1] is info.grad
            assert len(call) == 2 + len(info.states) and all(map(operator.is_, call[2:], info.states.values()))
        repeated.append(buffers(opts[0])[0].repeated)
        steady.append(repeated[-1] and call is not None)
    assert not buffers(opts[1])[0].repeated
    quiet = (3, 4, 5, 6, 7, 8, 9, 12, 13, 15, 16, 17, 20, 21, 24, 25, 28, 29, 31)
    assert all(steady[k] for k in quiet), steady
    assert repeated[33] and repeated[35] and not steady[33] and not steady[35], (repeated, steady)


def test_the_eager_steady_call_binds_again_when_a_buffer_tensor_is_replaced():
    """The bound call is kept only while the buffer's tensors are the same objects: a state tensor replaced
    between two repeats (no path that does so keeps the repeat today; this is the call's own check) is the
    one the next step updates."""
    p = torch.nn.Parameter(torch.randn(16))
    opt = dml_optim.AdamW([p], lr=1e-2, backend="eager")
    for _ in range(4):
        p.grad = torch.ones(16) if p.grad is None else p.grad.fill_(1.0)
        opt.step()
    assert buffers(opt)[0].repeated and buffers(opt)[0].bound is not None
    flat = opt.buffers_by_group()[0][1][0]
    old, new = flat.states["exp_avg"], flat.states["exp_avg"].clone()
    flat.states["exp_avg"] = new
    before = old.clone()
    opt.step()
    assert buffers(opt)[0].repeated and buffers(opt)[0].bound[2] is new
    assert torch.equal(old, before) and not torch.equal(new, before)


def test_a_repeat_keeps_no_gradient_alive():
    """A repeat after ``zero_grad(set_to_none=True)`` does not hold the last step's gradients."""
    import weakref

    ps = [torch.nn.Parameter(torch.randn(8192)) for _ in range(2)]
    opt = dml_optim.AdamW(ps, lr=1e-3)
    refs = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        for p in ps:
            p.grad = torch.ones_like(p)
        refs = [weakref.ref(p.grad) for p in ps]
        opt.step()
    assert buffers(opt)[0].repeated
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)


def test_a_copy_plans_its_first_step_anew():
    ps = _params()
    opt = dml_optim.AdamW(ps, lr=1e-3, backend="eager")
    for step in range(3):
        for p, g in zip(ps, _grads(step)):
            p.grad = g if p.grad is None else p.grad.copy_(g)
        opt.step()
    assert buffers(opt)[0].repeated
    twin = copy.deepcopy(opt)
    twin.step()
    assert not buffers(twin)[0].repeated


def test_fused_plans_name_their_calls():
    ps = _params()
    opt = dml_optim.AdamW(ps, lr=1e-3)
    for p, g in zip(ps, _grads(0)):
        p.grad = g
    opt.step()
    (request,) = opt.step_requests()
    plan = plan_step(request)
    assert isinstance(plan, FusedPlan) and plan.calls and all(c.fn is torch._fused_adamw_ for c in plan.calls)
    assert decide(opt.owner, opt.param_groups[0], request.flat).plain == "fused"
    assert isinstance(request, StepRequest)
