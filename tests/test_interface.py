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
    flat = opt._layout[0].buffers[0]
    reason = backend.supports(opt, opt.param_groups[0], flat)
    if name == "eager":
        assert reason is None
    elif name == "fused":
        assert reason is None
        opt.param_groups[0]["nonfinite"] = "skip"
        assert "nonfinite" in backend.supports(opt, opt.param_groups[0], flat)
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
    (request,) = b._requests(False)  # (the layout's work: bindings checked, states allocated)
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
    (request,) = opt._requests(False)
    plan = plan_step(request)
    assert isinstance(plan, FusedPlan) and plan.calls and all(c.fn is torch._fused_adamw_ for c in plan.calls)
    assert decide(opt, opt.param_groups[0], request.flat).plain == "fused"
    assert isinstance(request, StepRequest)
