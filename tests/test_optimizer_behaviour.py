"""Behaviour users rely on: None grads, zero_grad, gathering, schedulers, closures,
add_param_group, data_ptr stability, DmlAdam's DirectML constraints.

Oracles: ``torch.optim.Adam`` with ``eps=0`` (equal to ``dml_optim.Adam`` with
``epsilon=0``, docs/design.md §2), ``torch.optim.Adagrad``/``SGD``, and direct
checks of storage and identity.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dml_optim
from dml_optim.cli import main
from dml_optim.optimizers.dml_adam import UINT32_MAX
from tolerances import assert_close, assert_close_to_reference
from introspect import buffers
from matrix import cases, classes, fused_cases

F64 = torch.float64


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().startswith("aten::"):
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _model(dtype=F64, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    ).to(dtype)


def _batch(step: int, dtype=F64):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(4, 2, 6, 6, generator=g, dtype=dtype), torch.randn(4, 2, generator=g, dtype=dtype)


def _loss(model, step, dtype=F64):
    x, y = _batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x), y)


def _flat_range(opt, buffer="data"):
    flat = buffers(opt)[0]
    t = getattr(flat, buffer)
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _iteration(pairs, step: int) -> None:
    """One training iteration (``zero_grad()``, backward of :func:`_loss` at ``step``, ``step()``) of each
    (model, optimizer) pair."""
    for model, opt in pairs:
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _assert_params_equal(a: torch.nn.Module, b: torch.nn.Module, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_close(p.detach(), q.detach(), **tol)


# --------------------------------------------------------------------------
# None grads
# --------------------------------------------------------------------------


def test_none_grad_params_are_skipped_exactly_like_torch_optim():
    """A parameter without a gradient is not updated, its state untouched, and its
    step count lags (so its bias correction differs), exactly as in torch.optim.Adam."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=g, dtype=F64) for s in [(4,), (2, 3), (), (3, 1, 2, 2)]]
    ours_p = [torch.nn.Parameter(t.clone()) for t in init]
    ref_p = [torch.nn.Parameter(t.clone()) for t in init]
    ours = dml_optim.Adam(ours_p, lr=0.01, epsilon=0.0)
    ref = torch.optim.Adam(ref_p, lr=0.01, eps=0.0, foreach=False)
    # skip[step] = indices of params with no gradient at that step
    skip = {0: {1}, 1: {1, 3}, 2: set(), 3: {0}, 4: {0, 2}, 5: {0, 1, 2, 3}, 6: {2}}
    for step in range(10):
        before = [p.detach().clone() for p in ours_p]
        sd_before = copy.deepcopy(ours.state_dict()["state"])
        for i, (p, q) in enumerate(zip(ours_p, ref_p)):
            if i in skip.get(step, set()):
                p.grad = None
                q.grad = None
            else:
                grad = torch.randn(p.shape, generator=g, dtype=F64)
                p.grad = grad.clone()
                q.grad = grad.clone()
        ours.step()
        ref.step()
        sd, rsd = ours.state_dict()["state"], ref.state_dict()["state"]
        for i, (p, q) in enumerate(zip(ours_p, ref_p)):
            assert_close(p.detach(), q.detach())
            if i in skip.get(step, set()):
                assert torch.equal(p.detach(), before[i]), f"param {i} changed at step {step} without a gradient"
                assert (i in sd) == (i in sd_before)
                if i in sd:
                    for key in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(sd[i][key], sd_before[i][key])
            assert (i in sd) == (i in rsd)
            if i in sd:
                assert float(sd[i]["step"]) == float(rsd[i]["step"])
                assert_close(sd[i]["exp_avg"], rsd[i]["exp_avg"])
                assert_close(sd[i]["exp_avg_sq"], rsd[i]["exp_avg_sq"])
    steps = {i: float(ours.state_dict()["state"][i]["step"]) for i in range(4)}
    assert steps == {0: 7.0, 1: 7.0, 2: 7.0, 3: 8.0}  # 10 steps minus the skips


#: How the changing None patterns step: per run (the CPU's eager and compiled way) or masked (DirectML's and
#: CUDA's, given to the CPU); fused (torch's kernel over runs of the flat buffer), with small parameters
#: (the fresh gradients gathered first) or parameters of LIST_MIN_ELEMENTS (read in place)
NONE_PATTERN_CASES = (
    [pytest.param(p.values[0], m, id=f"{p.id}-{m}", marks=p.marks)
     for p in cases(variants="all", dtypes=(F64,), devices=("cpu",)) for m in ("per-run", "masked")]
    + [pytest.param(p.values[0], "per-run", id=f"{p.id}-per-run", marks=p.marks)
       for p in cases(dtypes=(F64,), devices=("cpu",), backends=("compiled",))]
    # float64, and DmlAdam's float32 (its epsilon mapping depends on the step count: one call per count)
    + [pytest.param(p.values[0], m, id=f"{p.id}-{m}", marks=p.marks)
       for p in fused_cases(variants="all", dtypes="widest") for m in ("gathered", "in-place")]
)


@pytest.mark.parametrize("case,path", NONE_PATTERN_CASES)
def test_changing_none_patterns_follow_the_reference_per_parameter(case, path, monkeypatch):
    """Every variant, under ``None`` gradients that change every step (parameters at several step counts:
    one update per run, the CPU's way, or one masked update, DirectML's and CUDA's, given to the CPU
    here; torch's fused kernel over the runs, the CPU's default): each parameter with a gradient takes the
    float64 reference step from its own pre-step values and its own count; each one without keeps its
    values and state bit for bit."""
    from dml_optim.backends import choose as backends
    from dml_optim.backends.fused import FusedFallbackWarning, LIST_MIN_ELEMENTS

    if path == "masked":
        from dml_optim.backends import eager as engine

        monkeypatch.setattr(engine, "MASKED_DEVICES", (*engine.MASKED_DEVICES, "cpu"))
        monkeypatch.setitem(backends.AUTO_COMPILE_MIN_ELEMENTS_MASKED, "cpu", 1 << 16)
    gen = torch.Generator().manual_seed(21)
    shapes = [(5,), (2, 3), (), (4,), (3, 1), (7,), (2, 2), (1,), (6,), (3,)]
    if path == "in-place":  # (every parameter large enough: whatever the pattern, the gradients average that)
        shapes = [(LIST_MIN_ELEMENTS + 3 * i,) if i % 2 else (2, LIST_MIN_ELEMENTS // 2 + i) for i in range(len(shapes))]
    params = case.params(shapes, seed=4)
    opt = case.build(params, backend=case.backend)
    counts = [0] * len(params)
    distinct = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)
        for k in range(7):
            active = [(i * 7 + k * 3) % 5 < 3 or k == 0 for i in range(len(params))]
            distinct = max(distinct, len({c for c, a in zip(counts, active) if a}))
            grads = [case.randn(s, gen) if a else None for s, a in zip(shapes, active)]
            state = copy.deepcopy(opt.state_dict()["state"])
            before = [p.detach().clone() for p in params]
            for p, g in zip(params, grads):  # (the first ones held by nothing else: copies, `grads` kept here)
                p.grad = g.clone() if k == 0 and path != "in-place" and g is not None else g
            opt.step()
            if case.backend == "fused":  # the fresh gradients were read where they are, or copied into the flat
                present = [(p, g) for p, g in zip(params, grads) if g is not None]  # buffer: p.grad stays the caller's
                if path != "in-place" and k == 0:  # (the first gradients are gathered and adopted as views)
                    lo, hi = _flat_range(opt, "grad")
                    assert all(p.grad is not g and lo <= p.grad.data_ptr() < hi for p, g in present), k
                else:
                    assert all(p.grad is g for p, g in present), k
                if path != "in-place" and k > 0:
                    (info,) = opt.flat_buffers()
                    where = {i: n for n, i in enumerate(info.param_indices)}
                    offsets = [0]
                    for i in info.param_indices:
                        offsets.append(offsets[-1] + params[i].numel())
                    for i, g in enumerate(grads):
                        if g is not None:
                            n = where[i]
                            assert torch.equal(info.grad[offsets[n]:offsets[n + 1]], g.reshape(-1)), (k, i)
            after = opt.state_dict()["state"]
            for i, (p, g) in enumerate(zip(params, grads)):
                if g is None:
                    assert torch.equal(p.detach(), before[i]), (k, i)
                    for name in case.states if i in state else ():
                        assert torch.equal(after[i][name], state[i][name]), (k, i, name)
                    continue
                old = [state[i][n] if i in state else torch.full_like(before[i], case.cls.initial_state(opt.param_groups[0], n))
                       for n in case.states]
                x, s = case.reference_step(case.hyper, counts[i], before[i], g, old)
                assert_close_to_reference(p.detach(), x)
                for name, ref in zip(case.states, s):
                    assert_close_to_reference(after[i][name], ref)
                counts[i] += 1
    assert distinct >= 2  # several step counts at once: masked updates
    if case.backend == "fused":
        assert opt.resolved_backends() == [["fused"]]


def test_step_with_no_gradient_at_all_changes_nothing():
    p = torch.nn.Parameter(torch.randn(5, dtype=F64))
    before = p.detach().clone()
    opt = dml_optim.Momentum([p], lr=0.1)
    opt.step()
    assert torch.equal(p.detach(), before)
    assert opt.state_dict()["state"] == {}


# --------------------------------------------------------------------------
# zero_grad and gathering
# --------------------------------------------------------------------------


def test_zero_grad_is_one_op_and_keeps_views():
    model = _model()
    opt = dml_optim.Adam(model.parameters(), lr=0.01)
    _loss(model, 0).backward()
    opt.step()
    views = [p.grad for p in model.parameters()]
    lo, hi = _flat_range(opt, "grad")
    counter = OpCounter()
    with counter:
        opt.zero_grad()
    assert counter.ops == Counter({"aten::zero_": 1})
    for p, v in zip(model.parameters(), views):
        assert p.grad is v
        assert lo <= p.grad.data_ptr() < hi
        assert not p.grad.any()


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_zero_grad_set_to_none_runs_no_op_and_old_slots_do_not_reach_the_next_step(backend):
    """``zero_grad(set_to_none=True)`` writes nothing, as torch.optim's (the flat gradient buffer keeps the old
    values); a parameter that then gets no gradient is neither updated nor counted by clipping, however large
    its old gradient was."""
    ours_m, ref_m = _model(), _model()
    ours = dml_optim.Adam(ours_m.parameters(), lr=0.01, epsilon=0.0, backend=backend)
    ref = torch.optim.Adam(ref_m.parameters(), lr=0.01, eps=0.0, foreach=False)
    for step in range(2):  # (the second step's gradients accumulate in their views of the flat buffer)
        _iteration([(ours_m, ours), (ref_m, ref)], step)
    first = next(ours_m.parameters())
    lo, hi = _flat_range(ours, "grad")
    assert lo <= first.grad.data_ptr() < hi
    first.grad.fill_(1e30)  # (the slot's old value after the zero_grad below)
    counter = OpCounter()
    with counter:
        ours.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    assert counter.ops == Counter()
    assert all(p.grad is None for p in ours_m.parameters())
    for model in (ours_m, ref_m):
        _loss(model, 2).backward()
        next(model.parameters()).grad = None
    norm = dml_optim.clip_grad_norm_(ours, 1.0)
    assert_close(norm, torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 1.0))
    ours.step()
    ref.step()
    _assert_params_equal(ours_m, ref_m)


def test_backward_accumulates_into_the_flat_gradient_buffer():
    model = _model()
    opt = dml_optim.Adam(model.parameters(), lr=0.01)
    _loss(model, 0).backward()
    opt.step()  # gathers the first (autograd-allocated) gradients
    opt.zero_grad()
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    _loss(model, 1).backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_zero_grad_then_backward_then_step_matches_torch(set_to_none):
    ours_m, ref_m = _model(), _model()
    ours = dml_optim.Adam(ours_m.parameters(), lr=0.01, epsilon=0.0)
    ref = torch.optim.Adam(ref_m.parameters(), lr=0.01, eps=0.0, foreach=False)
    for step in range(6):
        ours.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=True)
        if set_to_none:
            assert all(p.grad is None for p in ours_m.parameters())
        _loss(ours_m, step).backward()
        _loss(ref_m, step).backward()
        ours.step()
        ref.step()
        _assert_params_equal(ours_m, ref_m)
        # after the first step every gradient is a view of the flat buffer (allocated then); after
        # zero_grad(set_to_none=True) the fresh gradients are copied into it and stay the caller's, as torch.optim's
        lo, hi = _flat_range(ours, "grad")
        if set_to_none and step > 0:
            assert not any(lo <= p.grad.data_ptr() < hi for p in ours_m.parameters())
            assert all(info.repeated for info in ours.flat_buffers()) or step == 1
        else:
            assert all(lo <= p.grad.data_ptr() < hi for p in ours_m.parameters())


def test_user_replaced_grad_is_gathered():
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=F64))
    q = torch.nn.Parameter(torch.randn(6, generator=g, dtype=F64))
    ref_p, ref_q = (torch.nn.Parameter(t.detach().clone()) for t in (p, q))
    ours = dml_optim.Adagrad([p, q], lr=0.1)
    ref = torch.optim.Adagrad([ref_p, ref_q], lr=0.1, eps=1e-10, foreach=False)
    for step in range(4):
        gp, gq = torch.randn(3, 4, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
        given = gp.clone(), gq.clone()
        p.grad, q.grad = given  # foreign tensors, not views of the flat buffer
        if step == 0:
            del given  # (nothing but the parameters holds the first ones)
        ref_p.grad, ref_q.grad = gp.clone(), gq.clone()
        ours.step()
        ref.step()
        lo, hi = _flat_range(ours, "grad")
        if step == 0:  # the first gradients are gathered and adopted: p.grad becomes its view of the flat buffer
            assert lo <= p.grad.data_ptr() < hi and lo <= q.grad.data_ptr() < hi
        else:  # fresh tensors the caller holds: copied into the flat buffer, p.grad stays the caller's (torch's)
            assert p.grad is given[0] and q.grad is given[1]
        assert torch.equal(p.grad, gp) and torch.equal(q.grad, gq)
        assert_close(p.detach(), ref_p.detach())
        assert_close(q.detach(), ref_q.detach())


# --------------------------------------------------------------------------
# schedulers and closures
# --------------------------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8, eta_min=1e-4),
}


@pytest.mark.parametrize("make_scheduler", list(SCHEDULERS.values()), ids=list(SCHEDULERS))
def test_lr_scheduler_behaves_as_on_torch_optim(make_scheduler):
    ours_m, ref_m = _model(), _model()
    ours = dml_optim.Adam(ours_m.parameters(), lr=0.05, epsilon=0.0)
    ref = torch.optim.Adam(ref_m.parameters(), lr=0.05, eps=0.0, foreach=False)
    ours_s, ref_s = make_scheduler(ours), make_scheduler(ref)
    ours_lrs, ref_lrs = [], []
    for step in range(10):
        _iteration([(ours_m, ours), (ref_m, ref)], step)
        ours_s.step()
        ref_s.step()
        ours_lrs.append(ours.param_groups[0]["lr"])
        ref_lrs.append(ref.param_groups[0]["lr"])
        _assert_params_equal(ours_m, ref_m)
    assert ours_lrs == ref_lrs
    assert len(set(ours_lrs)) > 2  # the schedule really changed the learning rate
    assert ours_s.get_last_lr() == ref_s.get_last_lr()


def test_closure_is_called_and_its_loss_returned():
    ours_m, ref_m = _model(), _model()
    ours = dml_optim.Momentum(ours_m.parameters(), lr=0.05, alpha=0.9)
    ref = torch.optim.SGD(ref_m.parameters(), lr=0.05, momentum=0.9, foreach=False)
    for step in range(5):
        def closure(model=ours_m, opt=ours, step=step):
            opt.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            return loss

        def ref_closure(model=ref_m, opt=ref, step=step):
            opt.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            return loss

        loss = ours.step(closure)
        ref_loss = ref.step(ref_closure)
        assert isinstance(loss, torch.Tensor)
        assert_close(loss.detach(), ref_loss.detach())
        _assert_params_equal(ours_m, ref_m)


# --------------------------------------------------------------------------
# param groups
# --------------------------------------------------------------------------


def test_add_param_group_after_construction():
    ours_m, ref_m = _model(), _model()
    ours_layers, ref_layers = list(ours_m.children()), list(ref_m.children())
    ours = dml_optim.Adam(ours_layers[0].parameters(), lr=0.01, epsilon=0.0)
    ref = torch.optim.Adam(ref_layers[0].parameters(), lr=0.01, eps=0.0, foreach=False)
    for step in range(3):
        for opt, m in ((ours, ours_m), (ref, ref_m)):
            opt.zero_grad()
            _loss(m, step).backward()
            opt.step()
    late = list(ours_layers[2].parameters()) + list(ours_layers[4].parameters())
    before = [p.detach().clone() for p in late]
    ours.add_param_group({"params": late, "lr": 0.02, "beta": 0.99})
    ref.add_param_group({"params": list(ref_layers[2].parameters()) + list(ref_layers[4].parameters()),
                         "lr": 0.02, "betas": (0.9, 0.99)})
    assert len({i.group for i in ours.flat_buffers()}) == 2
    flat = buffers(ours, 1)[0]
    lo, hi = flat.data.data_ptr(), flat.data.data_ptr() + flat.data.numel() * flat.data.element_size()
    assert all(lo <= p.data_ptr() < hi for p in late)  # the new params were packed
    for step in range(3, 8):
        for opt, m in ((ours, ours_m), (ref, ref_m)):
            opt.zero_grad()
            _loss(m, step).backward()
            opt.step()
        _assert_params_equal(ours_m, ref_m)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(late, before))  # trained
    with pytest.raises(ValueError, match="more than one parameter group"):
        ours.add_param_group({"params": [late[0]]})
    # a parameter twice in the new group: torch.optim warns, and so do we (keeping it once)
    fresh = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    with pytest.warns(UserWarning, match=r"param_groups\[2\] lists the same parameter twice"):
        ours.add_param_group({"params": [fresh, fresh]})
    assert ours.param_groups[2]["params"] == [fresh]


def test_group_hyperparameters_can_change_between_steps():
    """Schedulers and users write ``param_groups[i][...]``; the next step uses it."""
    p, q = torch.nn.Parameter(torch.zeros(3, dtype=F64)), torch.nn.Parameter(torch.zeros(2, dtype=F64))
    opt = dml_optim.Momentum([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 0.2, "alpha": 0.0}], lr=0.5)
    p.grad, q.grad = torch.ones(3, dtype=F64), torch.ones(2, dtype=F64)
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), -0.1, dtype=F64))
    assert torch.equal(q.detach(), torch.full((2,), -0.2, dtype=F64))
    opt.param_groups[1]["lr"] = 0.5
    opt.step()
    assert_close(q.detach(), torch.full((2,), -0.7, dtype=F64))
    opt.param_groups[1]["alpha"] = 2.0  # invalid: checked at the step, nothing written
    with pytest.raises(ValueError, match="alpha"):
        opt.step()
    assert_close(q.detach(), torch.full((2,), -0.7, dtype=F64))


# --------------------------------------------------------------------------
# packing: data_ptr stability and identity
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", classes())
def test_packing_keeps_parameters_and_module_outputs(case):
    """Every optimizer of the test matrix, in its widest dtype, on each device."""
    dtype = case.dtype
    model = _model(dtype).to(case.device)
    params = list(model.parameters())
    x = _batch(0, dtype)[0].to(case.device)
    with torch.no_grad():
        out_before = model(x).clone()
    opt = case.cls(model.parameters(), lr=0.01)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # same Parameter objects
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), out_before)
    lo, hi = _flat_range(opt)
    ptrs = [p.data_ptr() for p in params]
    assert all(lo <= ptr < hi for ptr in ptrs)
    assert opt.param_groups[0]["params"][0] is params[0]
    for step in range(3):
        opt.zero_grad()
        x_step, y_step = (t.to(case.device) for t in _batch(step, dtype))
        torch.nn.functional.mse_loss(model(x_step), y_step).backward()
        opt.step()
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    with torch.no_grad():
        assert not torch.equal(model(x), out_before)  # it trained, through the same objects


@pytest.mark.parametrize("kwargs", [dict(nonfinite="skip"), dict(nonfinite="raise"), dict(master_weights=True)])
def test_a_buffer_of_empty_parameters_steps(kwargs):
    dtype = torch.float16 if kwargs.get("master_weights") else torch.float32
    p = torch.nn.Parameter(torch.empty(0, dtype=dtype))
    q = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    opt = dml_optim.Adam([p, q] if not kwargs.get("master_weights") else [p], lr=0.1, **kwargs)
    p.grad = torch.empty(0, dtype=dtype)
    q.grad = torch.ones(2, dtype=dtype)
    opt.step()
    assert p.numel() == 0


# --------------------------------------------------------------------------
# DmlAdam: DirectML's constraints
# --------------------------------------------------------------------------


def test_dml_descriptors_are_valid_and_describe_the_flat_buffers(tmp_path, capsys):
    from dml_optim.dml import loads, validate

    model = _model(torch.float32)
    opt = dml_optim.DmlAdam([{"params": list(model[0].parameters())},
                             {"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 0.01}],
                            lr=0.001, beta1=0.85, epsilon=1e-7)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, torch.float32).backward()
        opt.step()
    descs = opt.dml_descriptors()
    assert len(descs) == 2
    numels = [sum(p.numel() for p in g["params"]) for g in opt.param_groups]
    for desc, numel, group in zip(descs, numels, opt.param_groups):
        json.dumps(desc)  # plain JSON
        report = validate(loads(json.dumps(desc)))
        assert report.valid, report
        sizes = desc["InputParametersTensor"]["Sizes"]
        assert torch.Size(sizes).numel() == numel
        assert desc["InputParametersTensor"]["DataType"] == "FLOAT32"
        assert desc["TrainingStepTensor"]["DataType"] == "UINT32"
        assert desc["TrainingStepValue"] == 4  # 3 completed steps, T counted from 1
        assert desc["LearningRate"] == pytest.approx(group["lr"])
        assert desc["Beta1"] == pytest.approx(0.85) and desc["Epsilon"] == pytest.approx(1e-7)
        bindings = desc["Bindings"]
        for a, b in (("InputParametersTensor", "OutputParametersTensor"),
                     ("InputFirstMomentTensor", "OutputFirstMomentTensor"),
                     ("InputSecondMomentTensor", "OutputSecondMomentTensor")):
            assert bindings[a] == bindings[b]  # in place
        path = tmp_path / f"desc{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(desc))
        capsys.readouterr()
        assert main(["validate", str(path)]) == 0, capsys.readouterr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_dml_adam_rejects_dtypes_directml_lacks(dtype):
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        dml_optim.DmlAdam([p])


def test_dml_adam_raises_before_the_step_counter_leaves_uint32():
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(torch.randn(3))
    opt = dml_optim.DmlAdam([p, q], lr=0.01)
    p.grad, q.grad = torch.randn(4), torch.randn(3)
    opt.step()
    for param in (p, q):
        opt.state[param]["step"] = UINT32_MAX - 1
    opt.step()  # T = 2**32 - 1: the last value a UINT32 holds
    assert buffers(opt)[0].step_counts == (UINT32_MAX,) * 2
    before = copy.deepcopy(opt.state_dict()["state"])
    params_before = [p.detach().clone(), q.detach().clone()]
    with pytest.raises(OverflowError, match="UINT32"):
        opt.step()  # T would be 2**32
    after = opt.state_dict()["state"]
    for k in before:
        for key in before[k]:
            assert torch.equal(before[k][key], after[k][key])
    assert torch.equal(p.detach(), params_before[0]) and torch.equal(q.detach(), params_before[1])
    assert buffers(opt)[0].step_counts == (UINT32_MAX,) * 2


def test_dml_descriptors_refuse_moments_in_another_dtype():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = dml_optim.DmlAdam([p], state_dtype=torch.float32, epsilon=1e-4)
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="one data type"):
        opt.dml_descriptors()
