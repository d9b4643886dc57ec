"""The optimizer follows its parameters (moves and casts after it was built).

Required behaviour (issue "The optimizer follows its parameters"): after
``model.to(...)``, ``.half()``, ``.double()`` or an accelerate-style re-binding
of ``p.data``, the next ``step()`` (and ``state_dict()``, ``zero_grad()``)
re-packs the flat buffers on the parameters' new device and dtype and carries
the existing state over with load_state_dict's casting rules (states cast to
the state dtype: by default the parameter dtype).  No state yet means nothing
to carry.  Only a changed shape is refused, naming the parameter.

This machine has one device (CPU): dtype changes stand for moves, and the meta
device serves as a second device where that means something (layout, not values).
References are torch.optim twins written by hand (``foreach=False``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from tolerances import TOL, TORCH_ADAM_FLOAT32, assert_close
from torch import nn

import dml_optim


@dataclass(frozen=True)
class Twin:
    id: str
    ours: Callable[..., torch.optim.Optimizer]
    theirs: Callable[..., torch.optim.Optimizer]
    adam_like: bool = False
    dtypes: tuple = (torch.float16, torch.float32, torch.float64)


TWINS = [
    Twin("adam", lambda ps, **kw: dml_optim.Adam(ps, lr=1e-2, alpha=0.9, beta=0.99, epsilon=0.0, norm_coefficient=0.01, **kw),
         lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.99), eps=0.0, weight_decay=0.01, foreach=False), True),
    Twin("dml-adam", lambda ps, **kw: dml_optim.DmlAdam(ps, lr=1e-2, beta1=0.9, beta2=0.99, epsilon=0.0, **kw),
         lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.99), eps=0.0, foreach=False), True,
         (torch.float16, torch.float32)),
    Twin("adamw", lambda ps, **kw: dml_optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, **kw),
         lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False), True),
    Twin("momentum", lambda ps, **kw: dml_optim.Momentum(ps, lr=1e-2, alpha=0.9, beta=0.7, norm_coefficient=0.01, **kw),
         lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=0.01, foreach=False)),
    Twin("adagrad", lambda ps, **kw: dml_optim.Adagrad(ps, lr=1e-2, decay_factor=0.01, epsilon=1e-10, norm_coefficient=0.01, **kw),
         lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, eps=1e-10, weight_decay=0.01, foreach=False)),
]

#: (from, to) dtype changes: widen, narrow, to half.  DmlAdam takes float32/float16 only.
CASTS = [(torch.float32, torch.float64), (torch.float64, torch.float32), (torch.float32, torch.float16),
         (torch.float16, torch.float32)]
CASES = [(t, a, b) for t in TWINS for a, b in CASTS if a in t.dtypes and b in t.dtypes]
CASE_IDS = [f"{t.id}-{str(a)[6:]}-to-{str(b)[6:]}" for t, a, b in CASES]

_CAST = {torch.float16: nn.Module.half, torch.float32: nn.Module.float, torch.float64: nn.Module.double}


def tol(twin: Twin, *dtypes) -> dict:
    """The coarsest dtype's tolerance (values computed in it persist after a widening cast)."""
    coarse = max(dtypes, key=lambda d: TOL[d]["rtol"])
    if coarse == torch.float32 and twin.adam_like:
        # torch.optim.Adam/AdamW vs ours in float32: the bias correction is computed in another
        # order (tests/tolerances.py: observed max 4e-7 relative over 50 steps)
        return dict(TOL[coarse], **TORCH_ADAM_FLOAT32)
    return dict(TOL[coarse])


def make_model(dtype) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


SHAPES = [(5, 6), (5,), (4, 5), (4,), (3, 4), (3,)]


def make_params(dtype) -> nn.ParameterList:
    """A parameter-only "model" (``.double()``/``.half()`` work on it) for the cast matrix."""
    g = torch.Generator().manual_seed(8)
    return nn.ParameterList([nn.Parameter(0.5 * torch.randn(s, generator=g)) for s in SHAPES]).to(dtype)


def _grads(n: int):
    """Gradients bounded away from zero (|g| in [0.5, 1.5]): Adam with epsilon 0 in float16 stays
    well defined (a gradient that underflows in g*g gives 0/0 in torch.optim and in ours alike),
    and the same for every run whatever its parameters (no feedback between runs)."""
    gen = torch.Generator().manual_seed(9)
    return [[torch.sign(torch.randn(s, generator=gen)) * (0.5 + torch.rand(s, generator=gen)) for s in SHAPES]
            for _ in range(n)]


def train_params(params: nn.ParameterList, opt, grads):
    """zero_grad, gradients arriving as autograd would hand them over (accumulated into an existing
    ``.grad``, or a fresh tensor), step."""
    opt.zero_grad()
    for p, g in zip(params, grads):
        g = g.to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)
    opt.step()


def _inputs(n: int):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(model, opt, batch):
    x, y = batch
    dtype = next(model.parameters()).dtype
    opt.zero_grad()
    ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
    opt.step()


def cast(model: nn.Module, dtype, how: str = "module"):
    if how == "module":
        _CAST[dtype](model)
    else:  # accelerate-style: every parameter re-bound by hand (gradients too)
        for p in model.parameters():
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)


def assert_models_close(a: nn.Module, b: nn.Module, **t):
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pa.dtype == pb.dtype
        torch.testing.assert_close(pa.detach(), pb.detach(), **t)


# -- cast before the first step -------------------------------------------------------------------


@pytest.mark.parametrize("twin,src,dst", CASES, ids=CASE_IDS)
def test_cast_after_construction_before_training_equals_torch(twin, src, dst):
    """Built on ``src`` parameters, the module cast to ``dst``, then trained 5 steps: equal to
    torch.optim built after the cast and to torch.optim built before it (it keeps its parameter
    references; torch.optim.Adagrad creates its ``sum`` at construction, in the old dtype, so its
    states get the cast by hand that ``_cast_torch_states`` describes).  No state yet, so nothing
    carried: the state dict stays empty until the first step."""
    model = make_params(src)
    before_model = copy.deepcopy(model)
    opt = twin.ours(list(model.parameters()))
    torch_before = twin.theirs(list(before_model.parameters()))
    cast(model, dst)
    cast(before_model, dst)
    _cast_torch_states(torch_before)
    after_model = copy.deepcopy(model)
    torch_after = twin.theirs(list(after_model.parameters()))
    assert opt.state_dict()["state"] == {}
    assert [(b.dtype, b.numel) for b in opt.flat_buffers()] == [(dst, sum(p.numel() for p in model.parameters()))]
    for grads in _grads(5):
        for m, o in ((model, opt), (before_model, torch_before), (after_model, torch_after)):
            train_params(m, o, grads)
        assert_models_close(model, after_model, **tol(twin, dst))
        assert_models_close(model, before_model, **tol(twin, dst))
    for p in model.parameters():
        assert p.dtype == dst and p.grad.dtype == dst


@pytest.mark.parametrize("how", ["module", "rebind-data"])
@pytest.mark.parametrize("twin", TWINS[:1] + TWINS[3:4], ids=["adam", "momentum"])
def test_accelerate_style_rebinding_is_followed(twin, how):
    """``p.data = p.data.to(dtype)`` on every parameter by hand is followed like ``model.double()``."""
    model = make_model(torch.float32)
    twin_model = copy.deepcopy(model)
    opt, topt = twin.ours(list(model.parameters())), twin.theirs(list(twin_model.parameters()))
    batches = _inputs(6)
    for batch in batches[:3]:
        train(model, opt, batch)
        train(twin_model, topt, batch)
    cast(model, torch.float64, how)
    cast(twin_model, torch.float64, how)
    _cast_torch_states(topt)
    for batch in batches[3:]:
        train(model, opt, batch)
        train(twin_model, topt, batch)
        assert_models_close(model, twin_model, **tol(twin, torch.float32))
    assert [b.dtype for b in opt.flat_buffers()] == [torch.float64]


# -- cast in the middle of training ----------------------------------------------------------------------


def _cast_torch_states(topt: torch.optim.Optimizer):
    """What torch.optim needs after a cast (its states keep the old dtype, and its kernels refuse
    mixed dtypes): every floating state but ``step`` cast to its parameter's dtype, the rule
    torch's own ``load_state_dict`` applies (``_process_value_according_to_param_policy``)."""
    for p, state in topt.state.items():
        for k, v in list(state.items()):
            if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                state[k] = v.to(p.dtype)


@pytest.mark.parametrize("twin,src,dst", CASES, ids=CASE_IDS)
def test_cast_mid_training_carries_state_like_torch(twin, src, dst):
    """3 steps, cast, 3 more: equal to torch.optim whose states were cast by hand the same way
    (``_cast_torch_states``); step counts carry over."""
    model = make_params(src)
    twin_model = copy.deepcopy(model)
    opt, topt = twin.ours(list(model.parameters())), twin.theirs(list(twin_model.parameters()))
    grads = _grads(6)
    for g in grads[:3]:
        train_params(model, opt, g)
        train_params(twin_model, topt, g)
    cast(model, dst)
    cast(twin_model, dst)
    _cast_torch_states(topt)
    for g in grads[3:]:
        train_params(model, opt, g)
        train_params(twin_model, topt, g)
        assert_models_close(model, twin_model, **tol(twin, src, dst))
    (info,) = opt.flat_buffers()
    assert info.dtype == dst and info.step_counts == (6,) * len(info.param_indices)
    tstate = topt.state_dict()["state"]
    for i, s in opt.state_dict()["state"].items():
        for name, v in tstate[i].items():
            if name != "step":
                assert v.dtype == dst and s[name].dtype == dst
                torch.testing.assert_close(s[name], v, **tol(twin, src, dst))


@pytest.mark.parametrize("twin", TWINS, ids=[t.id for t in TWINS])
def test_state_dict_right_after_a_cast_reports_the_new_dtype(twin):
    src, dst = (torch.float32, torch.float16) if twin.id == "dml-adam" else (torch.float32, torch.float64)
    model = make_params(src)
    opt = twin.ours(list(model.parameters()))
    for g in _grads(2):
        train_params(model, opt, g)
    before = copy.deepcopy(opt.state_dict()["state"])
    cast(model, dst)
    after = opt.state_dict()["state"]
    assert sorted(after) == sorted(before)
    for i, s in after.items():
        for name, v in s.items():
            if name == "step":
                assert float(v) == float(before[i][name]) == 2.0
                continue
            assert v.dtype == dst, (i, name, v.dtype)
            assert torch.equal(v, before[i][name].to(dst)), (i, name)  # carried, cast as load_state_dict casts


def test_explicit_state_dtype_is_kept_through_a_cast():
    """With ``state_dtype=float32`` the states are cast to the state dtype (unchanged), not to the
    parameters' new dtype; the parameters' buffer follows them to float64."""
    model = make_model(torch.float32)
    opt = TWINS[0].ours(list(model.parameters()), state_dtype=torch.float32)
    for batch in _inputs(2):
        train(model, opt, batch)
    before = copy.deepcopy(opt.state_dict()["state"])
    cast(model, torch.float64)
    train(model, opt, _inputs(3)[2])
    (info,) = opt.flat_buffers()
    assert info.dtype == torch.float64
    assert all(s.dtype == torch.float32 for s in info.states.values())
    after = opt.state_dict()["state"]
    assert float(after[0]["step"]) == 3.0
    assert not torch.equal(after[0]["exp_avg"], before[0]["exp_avg"])  # it stepped from the carried state


@pytest.mark.parametrize("how", ["module", "rebind-data"])
def test_zero_grad_right_after_a_cast_leaves_grads_in_the_new_dtype(how):
    model = make_model(torch.float32)
    opt = TWINS[0].ours(list(model.parameters()))
    train(model, opt, _inputs(1)[0])
    cast(model, torch.float64, how)
    opt.zero_grad()
    (info,) = opt.flat_buffers()
    assert info.dtype == torch.float64 and info.grad.dtype == torch.float64
    home = info.grad.untyped_storage().data_ptr()
    for p in model.parameters():
        assert p.dtype == torch.float64
        assert p.grad is not None and p.grad.dtype == torch.float64
        assert p.grad.untyped_storage().data_ptr() == home  # a view of the new flat gradient buffer
        assert p.grad.abs().sum() == 0
        assert p.data.untyped_storage().data_ptr() == info.data.untyped_storage().data_ptr()
    # and the next backward + step uses them
    x, y = _inputs(2)[1]
    ((model(x.double()) - y.double()) ** 2).mean().backward()
    assert info.grad.abs().sum() > 0
    opt.step()


_ROUND_TRIPS = {
    "to-float64-and-back": lambda m: m.to(torch.float64).to(torch.float32),
    "half-and-back": lambda m: m.half().float(),
    "grad-data-rebound": lambda m: [setattr(p.grad, "data", p.grad.data.clone()) for p in m.parameters()],
}


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("how", sorted(_ROUND_TRIPS))
def test_zero_grad_zeroes_gradients_whose_data_was_rebound(how, backend):
    """A round trip of casts (``model.to()`` re-points each gradient's ``.data``, the gradient object staying the
    same) or a ``p.grad.data = t`` between steps: ``zero_grad(set_to_none=False)`` zeroes what ``p.grad`` holds,
    as torch's does, so the next backward does not add to the old gradient (it once zeroed only the flat buffer)."""
    ours_model, torch_model = make_model(torch.float32), make_model(torch.float32)
    torch_model.load_state_dict(ours_model.state_dict())
    twin = TWINS[2]  # AdamW
    ours, theirs = twin.ours(list(ours_model.parameters()), backend=backend), twin.theirs(list(torch_model.parameters()))
    for k, (x, y) in enumerate(_inputs(4)):
        for model, opt in ((ours_model, ours), (torch_model, theirs)):
            opt.zero_grad(set_to_none=False)
            if k == 2:
                assert all(p.grad.abs().sum() == 0 for p in model.parameters())
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if k == 1:
                _ROUND_TRIPS[how](model)
        for a, b in zip(ours_model.parameters(), torch_model.parameters()):
            assert_close(a, b, **TORCH_ADAM_FLOAT32)


# -- what cannot be followed ------------------------------------------------------------------------------


@pytest.mark.parametrize("rebind", ["reshape", "other-size"])
def test_changed_shape_is_refused_naming_the_parameter_and_changes_nothing(rebind):
    torch.manual_seed(5)
    ps = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in [(4,), (2, 3), (5,)]]
    opt = TWINS[0].ours(ps)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    (info,) = opt.flat_buffers()
    states = {n: t.clone() for n, t in info.states.items()}
    others = [ps[0].detach().clone(), ps[2].detach().clone()]
    opt.zero_grad(set_to_none=True)  # (torch refuses p.data of another shape while p.grad has the old one)
    if rebind == "reshape":
        ps[1].data = ps[1].data.reshape(3, 2)
    else:
        ps[1].data = torch.zeros(7, dtype=torch.float64)
    for p in ps:
        p.grad = torch.randn(p.shape, dtype=torch.float64)
    with pytest.raises((RuntimeError, ValueError), match=re.escape("param_groups[0]['params'][1]")):
        opt.step()
    assert torch.equal(ps[0], others[0]) and torch.equal(ps[2], others[1])
    (info,) = opt.flat_buffers()
    assert info.step_counts == (2, 2, 2)
    for n, t in states.items():
        assert torch.equal(info.states[n], t), n


def test_rebinding_one_middle_parameter_same_dtype_and_shape_is_adopted():
    """``p.data = new_tensor`` (same dtype and shape) on a middle parameter: the next step starts
    from the new values (copied into the buffer; the parameter is a view of it again), its state is
    kept, and parameters and states follow torch.optim (which updates the new tensor in place)."""
    torch.manual_seed(6)
    ps = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in [(4,), (2, 3), (3, 3), (5,)]]
    ts = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = TWINS[0].ours(ps), TWINS[0].theirs(ts)
    g = torch.Generator().manual_seed(7)
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps] for _ in range(6)]

    def step(k):
        for p, t, gr in zip(ps, ts, grads[k]):
            p.grad, t.grad = gr.clone(), gr.clone()
        opt.step()
        topt.step()

    for k in range(3):
        step(k)
    new = torch.full((2, 3), 0.25, dtype=torch.float64)
    ps[1].data = new.clone()
    ts[1].data = new.clone()
    for k in range(3, 6):
        step(k)
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
    (info,) = opt.flat_buffers()
    home = info.data.untyped_storage().data_ptr()
    assert all(p.data.untyped_storage().data_ptr() == home for p in ps)
    assert info.step_counts == (6, 6, 6, 6)
    tstate = topt.state_dict()["state"]
    for i, s in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(s[name], tstate[i][name])


# -- devices ------------------------------------------------------------------------------------------------


def test_group_on_two_devices_gets_one_buffer_per_device():
    a = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.empty(4, 2, device="meta"))
    c = nn.Parameter(torch.randn(2, 2))
    d = nn.Parameter(torch.empty(5, device="meta"))
    opt = dml_optim.Adam([a, b, c, d], lr=1e-3)
    infos = {str(i.device): i for i in opt.flat_buffers()}
    assert sorted(infos) == ["cpu", "meta"]
    assert sorted(infos["cpu"].param_indices) == [0, 2] and infos["cpu"].numel == 7
    assert sorted(infos["meta"].param_indices) == [1, 3] and infos["meta"].numel == 13
    assert all(i.group == 0 for i in infos.values())
    assert a.device.type == "cpu" and b.device.type == "meta"
