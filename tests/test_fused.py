"""The fused backend's own properties, the steady-state repeat of a step, and ``checks="refs"``.

The fused backend (dml_optim/backends/fused.py) calls torch's fused CPU kernels on the flat buffers; its
results are held to torch.optim's ``fused=True`` twin (the same kernel: equal but for the elements
its scalar tail computes in one layout and its vector loop in the other, 1 ulp per step: see
:data:`TWIN`) and to the float64 references in the matrix tests (tests/test_optimizers.py).  Here: what is particular to it (where it runs and
where it does not, fresh gradients read in place, counts it cannot take, the audit's view), the
repeat of a steady step (the ``repeat`` option: it must give bit for bit what the full path gives, under
every change a training loop can make between steps), and the O(1) binding check that is now the
default (every kind of re-binding seen, against torch's fused twin that re-reads its bindings
every step).
"""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch

import dml_optim
from dml_optim.backends import fused
from dml_optim.core.opcount import OpRecorder
from dml_optim.testing import binding_reads, step_limit_checks
from introspect import buffers

BIG = 1 << 14  # a parameter this large is read in place (fused.LIST_MIN_ELEMENTS)

#: ours and torch's fused twin, same hyperparameters (the twins of docs/design.md §2)
TWINS = {
    "adamw": (lambda p, **kw: dml_optim.AdamW(p, lr=1e-2, weight_decay=0.1, **kw),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True)),
    "adam": (lambda p: dml_optim.Adam(p, lr=1e-2, epsilon=0.0, weight_decay=0.01),
             lambda p: torch.optim.Adam(p, lr=1e-2, eps=0.0, weight_decay=0.01, fused=True)),
    "adagrad": (lambda p: dml_optim.Adagrad(p, lr=0.1, lr_decay=0.01),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, fused=True)),
    "sgd": (lambda p: dml_optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, fused=True)),
    "momentum": (lambda p: dml_optim.Momentum(p, lr=0.05, alpha=0.8, beta=0.7),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=1.0 - 0.7, fused=True)),
}


def _values(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _pair(name, shapes, dtype=torch.float32, **options):
    values = _values(shapes, dtype=dtype)
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    make_ours, make_theirs = TWINS[name]
    return ours, make_ours(ours, **options), theirs, make_theirs(theirs)


def _grads(shapes, step, dtype=torch.float32):
    return _values(shapes, seed=1000 + step, dtype=dtype)


#: torch's fused twin runs the same kernel over other tensors: an element in the kernel's scalar tail in one
#: layout (its last ``numel % vector width`` elements, where the compiler contracts a multiply-add) can be in
#: its vector loop in the other: 1 ulp apart per step (observed: 7.5e-9 absolute on values near 1 after 2 SGD
#: steps, 2 of 142 elements); over a few steps a handful of ulps
TWIN = dict(rtol=1e-6, atol=1e-6)


def _assert_equal(ours, theirs, what=""):
    """Bit for bit (ours against ours: the same kernel over the same layout is deterministic)."""
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert torch.equal(p.detach(), q.detach()), f"{what} parameter {i}: max |diff| {(p - q).abs().max().item()}"


def _assert_twin(ours, theirs, what=""):
    """Ours against torch's fused twin (:data:`TWIN`)."""
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), **TWIN, msg=lambda m, i=i: f"{what} parameter {i}: {m}")


# -- where it runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TWINS))
def test_auto_runs_fused_on_the_cpu_and_equals_torchs_fused_twin(name):
    shapes = [(7, 5), (BIG + 3,), (1,)]
    ours, opt, theirs, twin = _pair(name, shapes)
    for step in range(6):
        for p, q, g in zip(ours, theirs, _grads(shapes, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"{name} step {step}")
    assert opt.resolved_backends() == [["fused"]]


@pytest.mark.parametrize("options, why", [
    (dict(state_dtype=torch.float16), "state_dtype"),
    (dict(capturable=True), "capturable"),
    (dict(state_bits=8), "quantized"),
])
def test_explicit_fused_where_it_cannot_run_warns_once_and_runs_autos_choice(options, why):
    ps = [torch.nn.Parameter(torch.randn(5000)) for _ in range(2)]
    opt = dml_optim.AdamW(ps, lr=1e-3, backend="fused", **options)
    with pytest.warns(fused.FusedFallbackWarning, match=why) as record:
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
    assert len(record) == 1
    assert opt.resolved_backends()[0][0] in ("eager", "compiled")


def test_rules_no_torch_kernel_computes_are_not_fused():
    ps = [torch.nn.Parameter(torch.randn(10))]
    post = dml_optim.Adam(ps, lr=1e-3, norm_coefficient_post=0.01)  # ONNX's post-update decay: no torch kernel
    no_buffer = dml_optim.Momentum([torch.nn.Parameter(torch.randn(10))], lr=0.1, alpha=0.0, beta=0.5)
    for opt in (post, no_buffer):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        assert opt.resolved_backends() == [["eager"]]


def test_a_float16_buffer_is_not_fused():
    p = torch.nn.Parameter(torch.randn(10).half())
    opt = dml_optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.resolved_backends() == [["eager"]]


def test_the_audit_sees_the_directml_op_chain_not_the_fused_kernel():
    """Under a dispatch mode that is not the op counter (the audit), a fused buffer runs the eager rule, so
    what is recorded is what DirectML runs; the op counter (the bench) sees the fused step as it runs."""
    ps = [torch.nn.Parameter(torch.randn(100))]
    opt = dml_optim.AdamW(ps, lr=1e-3)
    ps[0].grad = torch.randn(100)
    opt.step()
    audit = OpRecorder(compiled=False)
    with audit:
        opt.step()
    assert "aten::_fused_adamw_" not in audit.counts() and audit.counts()["aten::addcdiv_"] == 1
    counter = OpRecorder(compiled=True)
    with counter:
        opt.step()
    assert counter.counts()["aten::_fused_adamw_"] == 1 and counter.ops == 1  # the kernel: no step-number write


# -- gradients read in place, and gathered ------------------------------------------------------------


def test_fresh_gradients_of_large_parameters_are_read_in_place():
    """After ``zero_grad(set_to_none=True)`` the gradients are fresh tensors: a fused step reads them where
    they are (no flat gradient buffer, no copy), and leaves ``p.grad`` the caller's, as torch.optim does."""
    shapes = [(BIG,), (BIG + 8,)]
    ours, opt, theirs, twin = _pair("adamw", shapes)
    for step in range(4):
        grads = _grads(shapes, step)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        mine = [p.grad for p in ours]
        opt.step()
        twin.step()
        assert all(p.grad is g for p, g in zip(ours, mine))
        _assert_twin(ours, theirs)
        opt.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    assert buffers(opt)[0].grad is None


def test_a_gradient_tensor_that_stays_is_gathered_once_and_the_steps_then_repeat():
    """A gradient tensor of the caller's that stays from step to step and is written into (backward
    accumulating into it, a model's ``zero_grad(set_to_none=False)``) is read in place once; the next step
    sees the same tensor with a new version, gathers it into the flat buffer and points ``p.grad`` at its
    view, and from then on steps repeat the plan (no planning, no gathering)."""
    shapes = [(BIG,), (BIG,)]
    ours, opt, theirs, twin = _pair("sgd", shapes)
    for p, q in zip(ours, theirs):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    mine = [weakref.ref(p.grad) for p in ours]  # (weakly: a gradient the caller holds stays the caller's)
    full = []  # the steps that took the full path (planning the layout, gathering)
    for step in range(5):
        for p, q, g in zip(ours, theirs, _grads(shapes, step)):
            p.grad.zero_()
            p.grad.add_(g)  # (what backward does to a gradient that stays)
            q.grad.copy_(g)
        opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"step {step}")
        if step == 0:
            assert all(p.grad is g() for p, g in zip(ours, mine)) and buffers(opt)[0].grad is None
        else:
            assert buffers(opt)[0].grad is not None and not any(p.grad is g() for p, g in zip(ours, mine))
        if not buffers(opt)[0].repeated:
            full.append(step)
    assert full == [0, 1]  # (step 1 gathers and records the bindings; then the steps repeat)


def test_the_same_read_only_gradients_handed_over_again_are_read_in_place_every_step():
    """Gradient tensors assigned anew each step (``p.grad = g``), even the same objects, and not written
    in between, are read where they are at every step: no copy."""
    shapes = [(BIG,), (BIG,)]
    ours, opt, theirs, twin = _pair("adamw", shapes)
    grads = _grads(shapes, 0)
    for step in range(4):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"step {step}")
        assert all(p.grad is g for p, g in zip(ours, grads)) and buffers(opt)[0].grad is None


def test_small_parameters_and_non_contiguous_gradients_are_gathered():
    """Small parameters: a kernel call per tensor costs more than one copy into the flat buffer; a
    non-contiguous gradient cannot be read as a flat range: both are gathered first.  (torch's own fused
    CPU kernels read a non-contiguous gradient as if it were contiguous: torch.optim.SGD(fused=True)
    steps a column-major gradient wrongly, on torch 2.4.1 and 2.13; the twin here gets contiguous ones.)"""
    for shapes, transpose in (([(3, 4), (5,)], False), ([(BIG // 64, 64), (BIG,)], True)):
        ours, opt, theirs, twin = _pair("adagrad", shapes)
        for step in range(3):
            for p, q, g in zip(ours, theirs, _grads(shapes, step)):
                mine = g.t().contiguous().t() if transpose and g.dim() == 2 else g.clone()  # same values
                assert mine.is_contiguous() is not (transpose and g.dim() == 2)
                p.grad, q.grad = mine, g.clone()
            opt.step()
            twin.step()
            _assert_twin(ours, theirs)
        assert buffers(opt)[0].grad is not None


def test_torch_fused_misreads_a_non_contiguous_gradient():
    """Why non-contiguous gradients are gathered: torch's kernel itself reads them in memory order."""
    p = torch.nn.Parameter(torch.zeros(4, 3))
    g = torch.arange(12.0).view(3, 4).t()
    opt = torch.optim.SGD([p], lr=1.0, fused=True)
    p.grad = g.clone()
    opt.step()
    assert not torch.equal(p.detach(), -g)  # (if torch fixes this, the gather stays correct, only cautious)
    q = torch.nn.Parameter(torch.zeros(4, 3))
    ours = dml_optim.SGD([q], lr=1.0)
    q.grad = g.clone()
    ours.step()
    assert torch.equal(q.detach(), -g)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_changing_none_patterns_step_once_per_kernel_without_a_repack(name):
    """Parameters at several step counts keep the buffer's order (no re-pack): AdamW and SGD's later steps
    take one kernel call whatever the counts, Adam one per distinct count (its eps depends on it)."""
    shapes = [(BIG,)] * 5 if name != "sgd" else [(30,)] * 5
    ours, opt, theirs, twin = _pair(name, shapes)
    order = buffers(opt)[0].param_indices
    patterns = [(1, 1, 1, 1, 1), (1, 0, 1, 0, 1), (0, 1, 1, 1, 0), (1, 1, 0, 0, 1), (1, 0, 1, 1, 1)]
    for step, mask in enumerate(patterns * 2):
        for p, q, g, m in zip(ours, theirs, _grads(shapes, step), mask):
            p.grad, q.grad = (g.clone(), g.clone()) if m else (None, None)
        counter = OpRecorder(compiled=True)
        with counter:
            opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"step {step}")
        before = {c - 1 for c, m in zip(buffers(opt)[0].step_counts, mask) if m}  # the counts that stepped
        kernels = sum(n for k, n in counter.counts().items() if "_fused_" in k)
        # SGD: dampening 0 for a first step; Adam with epsilon 0: eps 0 whatever the count
        assert kernels == (len({c == 0 for c in before}) if name == "sgd" else 1)
    assert buffers(opt)[0].param_indices == order


def test_adam_with_an_epsilon_takes_one_call_per_distinct_count():
    """ONNX Adam's epsilon goes before the bias correction: torch's eps is epsilon / sqrt(1 - beta**T), one
    value per count; the result follows the ONNX rule (against the eager backend, which runs it as written)."""
    shapes = [(BIG,)] * 3
    values = _values(shapes)
    ps, qs = ([torch.nn.Parameter(v.clone()) for v in values] for _ in range(2))
    opt = dml_optim.Adam(ps, lr=1e-2, epsilon=1e-3)
    ref = dml_optim.Adam(qs, lr=1e-2, epsilon=1e-3, backend="eager")
    for step, mask in enumerate([(1, 1, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]):
        for p, q, g, m in zip(ps, qs, _grads(shapes, step), mask):
            p.grad, q.grad = (g.clone(), g.clone()) if m else (None, None)
        counter = OpRecorder(compiled=True)
        with counter:
            opt.step()
        ref.step()
        before = {c - 1 for c, m in zip(buffers(opt)[0].step_counts, mask) if m}
        assert counter.counts()["aten::_fused_adam_"] == len(before)
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


def test_a_count_the_kernel_cannot_take_runs_the_rule():
    """torch's kernels read the step number as a float32: past 2**24 the buffer runs the eager rule."""
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    big = dml_optim.AdamW([p], lr=1e-3)
    ref = dml_optim.AdamW([q], lr=1e-3, backend="eager")
    for opt in (big, ref):
        sd = opt.state_dict()
        sd["state"] = {0: {"step": torch.tensor(float(fused.MAX_COUNT + 1)), "exp_avg": torch.full((10,), 0.1, dtype=torch.float64),
                           "exp_avg_sq": torch.full((10,), 0.01, dtype=torch.float64)}}
        opt.load_state_dict(sd)
    g = torch.randn(10, dtype=torch.float64)
    p.grad, q.grad = g.clone(), g.clone()
    big.step()
    ref.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_step_under_another_default_device_equals_torch(name):
    """A step taken while a caller's default device is another one (``with torch.device(...)``,
    ``torch.set_default_device``: here "meta") makes its host tensors (step numbers, range checks) on the
    CPU, as torch.optim's fused step does: the same result as torch's twin, not an error."""
    shapes = [(7, 5), (BIG + 3,), (1,)]
    ours, opt, theirs, twin = _pair(name, shapes)
    for step in range(3):
        for p, q, g in zip(ours, theirs, _grads(shapes, step)):
            p.grad, q.grad = g.clone(), g.clone()
        with torch.device("meta"):
            opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"step {step}")


# -- the steady-state repeat ---------------------------------------------------------------------------


def _repeating_and_not(name, shapes, checks):
    """Two copies of the same parameters and an optimizer ``name`` over each, with ``checks``; the second
    never repeats a step (it plans every step from scratch): (params, optimizers)."""
    values = _values(shapes)
    params = [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(2)]
    opts = [TWINS[name][0](ps) for ps in params]
    for opt in opts:
        opt.checks = checks
    opts[1].repeat = False  # (plans every step from scratch)
    return params, opts


def _loop(opts, params, step, events):
    """One training-loop step for every optimizer: our zero_grad (gradient views kept), gradients
    written in place as autograd accumulates, then whatever ``events`` does at this step."""
    for opt, ps in zip(opts, params):
        opt.zero_grad()
        for i, p in enumerate(ps):
            g = torch.sin((i + 1) * (step + 1) * torch.linspace(0, 1, p.numel(), dtype=p.dtype)).view_as(p)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        events(step, opt, ps)
        opt.step()


def _events(step, opt, ps):
    group = opt.param_groups[0]
    if step == 5:
        group["lr"] *= 0.5  # a scheduler
    if step == 8:
        ps[1].grad = None  # a parameter without a gradient this step
    if step == 11:
        ps[0].grad = ps[0].grad.clone()  # a fresh gradient tensor
    if step == 14:
        ps[2].requires_grad_(False)  # frozen ...
    if step == 17:
        ps[2].requires_grad_(True)  # ... and unfrozen
    if step == 20:
        sd = opt.state_dict()
        opt.load_state_dict(sd)
    if step == 23:
        ps[1].data = ps[1].detach().clone()  # re-bound parameter values
    if step == 26:
        opt.add_param_group({"params": [ps[3]], "lr": 0.02})


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("checks", ["refs", "full", "fast"])
def test_the_repeated_step_equals_the_full_path_under_every_change(name, checks):
    shapes = [(6, 5), (40,), (3,), (7,)]
    make = TWINS[name][0]
    values = _values(shapes)
    params = [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(2)]
    opts = [make(ps[:3]) for ps in params]
    for opt in opts:
        opt.checks = checks
    opts[1].repeat = False  # (plans every step from scratch)
    repeats = []
    for step in range(30):
        _loop(opts, params, step, _events)
        _assert_equal(params[0], params[1], f"{name} checks={checks} step {step}")
        repeats.append(all(b.repeated for b in opts[0].flat_buffers()))
    assert not any(b.repeated for b in opts[1].flat_buffers())
    assert sum(repeats) >= 5  # the quiet stretches of the loop repeat the plan (steps 2-4 at least)


def _fresh_loop(opts, params, held, step):
    """One step of a loop that hands fresh gradient tensors over (``zero_grad(set_to_none=True)``, then
    backward), a changing third of them ``None`` (steps 0-9 and 20-29), or (steps 10-14) our ``zero_grad()``
    with the gradients written into the views it keeps; then the events of the loop."""
    for opt, ps, last in zip(opts, params, held):
        if 10 <= step < 15:
            opt.zero_grad()
        for i, p in enumerate(ps):
            g = torch.sin((i + 1) * (step + 1) * torch.linspace(0, 1, p.numel(), dtype=p.dtype)).view_as(p)
            if 10 <= step < 15 and p.grad is not None:
                p.grad.copy_(g)
            elif step < 10 or step >= 20:
                p.grad = None if (i + step) % 3 == 0 else g
            else:
                p.grad = g
            last[i] = p.grad
        if step == 7:
            opt.param_groups[0]["lr"] *= 0.5  # a scheduler
        if step == 17:  # a gradient that stays and is written into (accumulated): gathered
            ps[0].grad = last[0] = held[0][0] if held[0][0] is not None else ps[0].grad
        if step == 18:
            ps[0].grad.mul_(0.5)
        if step == 22:
            ps[2].requires_grad_(False)  # frozen ...
            ps[2].grad = None
        if step == 24:
            ps[2].requires_grad_(True)  # ... and unfrozen
        if step == 25:
            opt.load_state_dict(opt.state_dict())
        if step == 27:
            ps[1].data = ps[1].detach().clone()  # re-bound parameter values
        opt.step()


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("checks", ["refs", "full", "fast"])
def test_the_repeated_in_place_step_equals_the_full_path_under_every_change(name, checks):
    """Gradients read where they are (parameters of 16k elements: fresh tensors after
    ``zero_grad(set_to_none=True)``, a changing third of them ``None``) repeat the last step's plan after the
    same checks of the gradients (:meth:`_reads_again`), bit for bit equal to an optimizer that never repeats,
    through a scheduler, gradient views and back, a gradient written into, freezing, a reload and re-bound
    values."""
    shapes = [(128, 128), (BIG,), (64, 256), (BIG + 8,)]
    params, opts = _repeating_and_not(name, shapes, checks)
    read_again = []  # per step: the steps whose every buffer repeated the last step (the public flag)
    held = [[None] * len(shapes) for _ in opts]
    for step in range(30):
        _fresh_loop(opts, params, held, step)
        read_again.append(all(info.repeated for info in opts[0].flat_buffers()))
        assert not any(info.repeated for info in opts[1].flat_buffers())
        _assert_equal(params[0], params[1], f"{name} checks={checks} step {step}")
        for ours, theirs in zip(params[0], params[1]):
            assert (ours.grad is None) == (theirs.grad is None)
    assert sum(read_again) >= 10, read_again  # the None patterns and fresh gradients repeated the plan
    mine, other = opts[0].flat_buffers(), opts[1].flat_buffers()
    for a, b in zip(mine, other):  # the same buffers, every parameter bound to its slice of them
        assert a.step_counts == b.step_counts and torch.equal(a.data, b.data)
        assert all(torch.equal(a.states[k], b.states[k]) for k in b.states)
        for info, ps in ((a, params[0]), (b, params[1])):
            base, end = info.data.data_ptr(), info.data.data_ptr() + info.numel * info.data.element_size()
            assert all(base <= ps[i].data_ptr() < end for i in info.param_indices)


def _absent_loop(opts, params, step):
    """A loop whose parameters 1 and 2 are frozen after the optimizer was built (their gradients stay
    ``None``), our ``zero_grad()`` keeping the views of the others; at steps 10-12 parameter 2 has a fresh
    gradient again (``None`` to a tensor: no use count shows it), and at step 16 a scheduler's write."""
    for opt, ps in zip(opts, params):
        opt.zero_grad()
        for i, p in enumerate(ps):
            g = torch.cos((i + 1) * (step + 1) * torch.linspace(0, 1, p.numel(), dtype=p.dtype)).view_as(p)
            if i in (1, 2) and not (i == 2 and 10 <= step <= 12):
                p.grad = None
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        if step == 16:
            opt.param_groups[0]["lr"] *= 0.5
        opt.step()


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("checks", ["refs", "full", "fast"])
def test_parameters_left_without_a_gradient_repeat_and_are_not_zeroed_each_step(name, checks):
    """Parameters frozen after the optimizer was built stay in its buffer without a gradient: a plain fused
    step neither zeroes their gradient slots (torch's kernel reads the runs with a gradient only: an O(frozen
    elements) pass a step, before) nor plans from scratch (the repeat checks that they are still ``None``),
    bit for bit equal to an optimizer that never repeats, through a gradient coming back and a scheduler."""
    shapes = [(32, 16), (600,), (40,), (24,)]
    params, opts = _repeating_and_not(name, shapes, checks)
    full = []  # the steps that planned from scratch (the public flag)
    for step in range(20):
        _absent_loop(opts, params, step)
        if not all(info.repeated for info in opts[0].flat_buffers()):
            full.append(step)
        _assert_equal(params[0], params[1], f"{name} checks={checks} step {step}")
    assert len(full) <= 8, full  # the steps between the changes repeat
    assert 10 in full and 13 in full  # (the gradient that came back, and left again, took the full path)
    # a step that plans from scratch (under an op counter: no repeat) writes nothing but the kernel's outputs
    for opt, ps in zip(opts, params):
        for i, p in enumerate(ps):
            if p.grad is not None:
                p.grad.copy_(torch.full_like(p, 0.5))
    with OpRecorder(compiled=True) as ops:
        opts[0].step()
    opts[1].step()
    _assert_equal(params[0], params[1], f"{name} checks={checks}, counted")
    assert "aten::zero_" not in ops.counts(), dict(ops.counts())


def test_clipping_after_a_fused_step_ignores_the_old_gradient_of_a_parameter_without_one():
    """The slot of a parameter whose gradient went ``None`` keeps its old value through fused steps (not
    zeroed: nothing reads it), and clipping, which reads the flat buffer, zeroes it first: the total norm is
    torch's over the gradients present, even when the old value was inf."""
    ours = [torch.nn.Parameter(torch.ones(8)) for _ in range(3)]
    ref = [torch.nn.Parameter(torch.ones(8)) for _ in range(3)]
    opt = dml_optim.AdamW(ours, lr=1e-3)
    opt.zero_grad()
    for p in ours:
        p.grad = torch.full((8,), float("inf")) if p is ours[1] else torch.ones(8)
    ours[1].grad = None  # (after the gather below, the slot would hold inf: write it there directly)
    opt.step()
    opt.zero_grad()
    buffers(opt)[0].grad[8:16].fill_(float("inf"))  # an old gradient in the slot of the parameter without one
    for p, q, g in zip(ours, ref, (torch.ones(8), None, torch.full((8,), 2.0))):
        if g is None:
            p.grad, q.grad = None, None
        else:
            p.grad.copy_(g)
            q.grad = g.clone()
    opt.step()  # fused, in place: the inf slot is not read
    assert torch.isfinite(torch.stack(list(ours))).all()
    total = dml_optim.clip_grad_norm_(opt, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(total, expected)


def test_the_repeat_is_not_used_where_the_full_path_must_run():
    """atomic=True, nonfinite checks, a dispatch mode: the full path every step."""
    for options in (dict(atomic=True), dict(nonfinite="raise"), dict(nonfinite="skip")):
        p = torch.nn.Parameter(torch.randn(50))
        opt = dml_optim.AdamW([p], lr=1e-3, **options)
        opt.zero_grad()
        for _ in range(3):
            p.grad = torch.ones(50) if p.grad is None else p.grad.fill_(1.0)
            opt.step()
            assert not buffers(opt)[0].repeated, options
    opt = _steady_adamw()
    with OpRecorder(compiled=False):
        opt.step()
    assert not buffers(opt)[0].repeated


def _steady_adamw():
    """An AdamW three steps in, its gradient in its view of the flat buffer, the last step a repeat: the next
    step may repeat."""
    p = torch.nn.Parameter(torch.randn(50))
    opt = dml_optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(50)
    opt.step()
    opt.zero_grad()
    opt.step()
    opt.step()
    assert buffers(opt)[0].repeated
    return opt


def test_a_copy_plans_its_first_step_from_scratch():
    opt = _steady_adamw()
    twin = copy.deepcopy(opt)
    twin.step()
    opt.step()
    assert not buffers(twin)[0].repeated and buffers(opt)[0].repeated


def test_the_repeat_runs_without_grad_and_gives_the_callers_grad_mode_back(monkeypatch):
    """``step()`` sets the grad mode of ``torch.no_grad()`` around the repeat of a steady step itself (the
    decorator cost a third of the repeat's host work): the kernel runs without grad, and the caller's mode,
    enabled or not, is the same after the step, also when the kernel raises."""
    real = torch._fused_adamw_
    seen = []

    def kernel(*args, fail=False, **kwargs):
        seen.append(torch.is_grad_enabled())
        if fail:
            raise RuntimeError("injected")
        real(*args, **kwargs)

    for enabled in (True, False):
        opt = _steady_adamw()
        monkeypatch.setattr(torch, "_fused_adamw_", kernel)
        with torch.set_grad_enabled(enabled):
            opt.step()
            assert torch.is_grad_enabled() is enabled and buffers(opt)[0].repeated
            monkeypatch.setattr(torch, "_fused_adamw_", lambda *args, **kwargs: kernel(*args, fail=True, **kwargs))
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
            assert torch.is_grad_enabled() is enabled
        assert seen == [False, False], seen  # (the second raised)
        monkeypatch.undo()
        seen.clear()


# -- checks="refs": every re-binding is seen -------------------------------------------------------------


def _rebind_grad(ps, qs):
    ps[0].grad = ps[0].grad.clone()


def _rebind_grad_data(ps, qs):
    ps[1].grad.data = ps[1].grad.data.clone()  # what model.to() does to the gradients it finds


def _grad_to_none(ps, qs):
    ps[2].grad = None
    qs[2].grad = None


def _rebind_param(ps, qs):
    ps[0].data = ps[0].detach().clone()


def _model_to_float64_and_back(ps, qs):
    for p in ps:
        p.data = p.data.double()
        if p.grad is not None:
            p.grad.data = p.grad.data.double()
    for p in ps:
        p.data = p.data.float()
        if p.grad is not None:
            p.grad.data = p.grad.data.float()


def _hold_an_alias(ps, qs):
    ps[0].held = ps[0].grad.view(-1)  # an extra view of the buffer, kept: a diagnosis finds nothing wrong


def _drop_the_alias(ps, qs):
    if hasattr(ps[0], "held"):
        del ps[0].held


REBINDINGS = {
    "grad-replaced": _rebind_grad,
    "grad-data-replaced": _rebind_grad_data,
    "grad-none": _grad_to_none,
    "param-data-replaced": _rebind_param,
    "model-cast-round-trip": _model_to_float64_and_back,
    "alias-held-then-dropped": lambda ps, qs: (_hold_an_alias(ps, qs)),
}


@pytest.mark.parametrize("checks", ["full", "refs"])
@pytest.mark.parametrize("rebind", sorted(REBINDINGS))
def test_the_checks_see_every_rebinding_and_the_steps_stay_torchs(rebind, checks):
    """Re-bindings made while nothing else holds the old tensors: the default ``"full"`` and the counts alone
    (``"refs"``) see every one."""
    shapes = [(8, 4), (50,), (3,)]
    ours, opt, theirs, twin = _pair("adamw", shapes, checks=checks)
    assert opt.checks == checks
    for step in range(8):
        opt.zero_grad()
        twin.zero_grad()
        for p, q, g in zip(ours, theirs, _grads(shapes, step)):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            q.grad = g.clone()
        if step == 3:
            REBINDINGS[rebind](ours, theirs)
        if step == 6:
            _drop_the_alias(ours, theirs)
        opt.step()
        twin.step()
        _assert_twin(ours, theirs, f"{rebind} step {step}")


@pytest.mark.parametrize("checks", ["refs", "full"])
def test_refs_is_o1_a_steady_step_reads_no_parameter(checks):
    """``checks="refs"`` reads two use counts per buffer, no parameter: a step over 2,000 parameters reads
    no data pointer and no ``.grad`` of any of them (the default ``"full"`` reads each once)."""
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(2000)]
    opt = dml_optim.SGD(ps, lr=0.1, momentum=0.9, checks=checks)
    for p in ps:
        p.grad = torch.ones(4)
    opt.step()
    opt.zero_grad()
    opt.step()
    opt.step()
    assert buffers(opt)[0].repeated
    with binding_reads() as reads:
        opt.step()
    assert buffers(opt)[0].repeated
    assert dict(reads) == ({} if checks == "refs" else {"data_ptr": 2000, "grad": 2000})


def test_full_also_sees_a_parameter_rebound_inside_its_own_buffer():
    """The one change the use counts cannot see: a parameter re-bound to another place of the same buffer
    (``p1.data = p2.data``: no tensor leaves or joins the storage).  ``checks="full"`` sees it and adopts
    the values (copies them back into the parameter's own slice), as it always did."""
    values = _values([(5,), (5,)])
    for checks in ("full", "refs"):
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        opt = dml_optim.SGD(ps, lr=0.1, checks=checks)
        for p in ps:
            p.grad = torch.ones(5)
        opt.step()
        opt.zero_grad()
        for p in ps:
            p.grad.fill_(1.0)
        opt.step()
        assert buffers(opt)[0].repeated
        ps[0].data = ps[1].data  # tie p0 to p1's slice
        opt.step()  # ("refs" does not see it: the step repeats; "full" sees it, diagnoses and adopts the values)
        assert buffers(opt)[0].repeated is (checks == "refs")
        assert (ps[0].data_ptr() == buffers(opt)[0].data.data_ptr()) is (checks == "full")


def test_the_default_is_full_and_bad_modes_are_refused():
    p = torch.nn.Parameter(torch.randn(3))
    assert dml_optim.AdamW([p]).checks == "full"
    with pytest.raises(ValueError, match="checks"):
        dml_optim.AdamW([p], checks="none")


def test_no_warnings_on_the_default_path():
    ps = [torch.nn.Parameter(torch.randn(100)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = dml_optim.AdamW(ps)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(100)
            opt.step()


@pytest.mark.parametrize("name", ["adam", "dml-adam", "adamw", "adagrad", "momentum", "sgd"])
def test_each_class_says_truly_how_its_kernel_arguments_depend_on_the_count(name):
    """``fused_counts`` lets a step compute a kernel's arguments once per distinct value instead of once
    per distinct count: it must say no less than the truth (checked over counts 0 to 50)."""
    from dml_optim.optimizers import registry
    from matrix import ENTRIES

    cls = registry.get(name)
    for variant in ENTRIES[name].variants:
        hyper = {**cls.spec.defaults(), **variant.hyper}
        if cls.fused_kernel(hyper, 0) is None:
            continue
        args = [cls.fused_kernel(hyper, n) for n in range(51)]
        if cls.fused_counts == "none":
            assert all(a == args[0] for a in args), variant.id
        elif cls.fused_counts == "first":
            assert all(a == args[1] for a in args[1:]), variant.id
        else:
            assert cls.fused_counts == "each"


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_per_step_scalars_beyond_the_dtype_are_refused_before_any_write(backend):
    """AdamW's step size is lr * sqrt(1 - b2**T) / (1 - b1**T): with lr = 2e38 and b1 = 0.99 it is 6.3e38 at
    T = 1, beyond float32 (the kernel would write inf): refused, nothing written, on every backend.  At
    T = 10 it is 2.1e38 (and smaller later): a buffer past its first counts steps (the fused backend checks
    the next 256 counts at once, and each count alone only when one of them is out of range)."""
    p = torch.nn.Parameter(torch.randn(64))
    opt = dml_optim.AdamW([p], lr=2e38, betas=(0.99, 0.999), weight_decay=0.0, backend=backend)
    p.grad = torch.randn(64)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="step_size=.*beyond the range of torch.float32"):
        opt.step()
    assert torch.equal(p.detach(), before) and buffers(opt)[0].step_counts == (0,)
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(9.0), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.ones(64)}}
    opt.load_state_dict(sd)
    for _ in range(3):
        opt.step()
    assert buffers(opt)[0].step_counts == (12,) and torch.isfinite(p).all()
    assert opt.resolved_backends() == [[backend]]


def test_the_range_check_runs_once_per_block_of_counts_not_once_per_step():
    """Parameters at counts far apart (a layer unfrozen late beside one trained for long): each count's
    block of 256 is checked once, not re-checked at every step (a single remembered range used to swing
    between the two, costing a check of 256 counts per step: 0.6 ms of 0.35)."""
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = dml_optim.AdamW([a, b], lr=1e-3)
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(5.0), "exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)},
                   1: {"step": torch.tensor(600.0), "exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)}}
    opt.load_state_dict(sd)
    with step_limit_checks() as calls:
        for _ in range(20):
            a.grad, b.grad = torch.ones(8), torch.ones(8)
            opt.step()
    assert sorted(calls) == [0, 512], calls  # (counts 5..24 in block 0, 600..619 in block 2)
    assert buffers(opt)[0].step_counts == (25, 620)


@pytest.mark.parametrize("checks", ["refs", "full"])
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_two_gradient_views_swapped_step_with_the_swapped_gradients(checks, backend):
    """``p1.grad, p2.grad = p2.grad, p1.grad`` between two same-shaped parameters: each parameter then
    steps with the other's gradient values, as torch.optim would.  The full check sees the swap; the
    gather reads every such view before writing any (it used to read one through the other's new
    values).  With ``"refs"`` a swap alone moves no count (the documented blind spot): the step uses the
    slots as they were; the test asserts exactly that, so a change of behaviour shows."""
    values = _values([(6,), (6,)])
    ps, qs = ([torch.nn.Parameter(v.clone()) for v in values] for _ in range(2))
    opt = dml_optim.SGD(ps, lr=0.1, checks=checks, backend=backend)
    twin = torch.optim.SGD(qs, lr=0.1)
    g = _grads([(6,), (6,)], 0)
    for p, q, gi in zip(ps, qs, g):
        p.grad, q.grad = gi.clone(), gi.clone()
    opt.step()
    twin.step()
    opt.zero_grad()
    for p, gi in zip(ps, g):
        p.grad.copy_(gi)
    ps[0].grad, ps[1].grad = ps[1].grad, ps[0].grad
    if checks == "full":
        qs[0].grad, qs[1].grad = qs[1].grad, qs[0].grad
    opt.step()
    twin.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), **TWIN)


@pytest.mark.parametrize("name", ["adam", "adamw", "adagrad", "sgd"])
def test_the_audit_of_a_fused_optimizer_is_the_directml_chain_without_allocations(name):
    """``dml-optim train`` audits its optimizer (``auto``: fused on the CPU) after training: the recorded
    step runs the eager chain, with the scratch a DirectML buffer keeps, so the report is the eager
    optimizer's: the same ops, nothing allocated (a fused step keeps no scratch: it is given one first)."""
    from dml_optim.audit import audit_step

    hyper = {"adam": dict(lr=1e-2, epsilon=0.0, weight_decay=0.01), "adamw": dict(lr=1e-2, weight_decay=0.1),
             "adagrad": dict(lr=0.1, lr_decay=0.01), "sgd": dict(lr=0.05, momentum=0.9, dampening=0.1)}[name]
    reports = []
    for backend in ("auto", "eager"):
        values = _values([(30, 20), (20,)])
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        opt = type(TWINS[name][0]([torch.nn.Parameter(torch.zeros(1))]))(ps, backend=backend, **hyper)
        for p, g in zip(ps, _grads([(30, 20), (20,)], 0)):
            p.grad = g
        opt.step()
        assert opt.resolved_backends() == [["fused" if backend == "auto" else "eager"]]
        reports.append(audit_step(opt))
    fused_report, eager_report = reports
    assert fused_report.allocations == eager_report.allocations == 0
    assert fused_report.total_ops == eager_report.total_ops and fused_report.ops == eager_report.ops
