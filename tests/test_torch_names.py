"""Drop-in: torch.optim's names in param groups and constructors.

Required behaviour (issue "Drop-in ... torch.optim's names in param groups"):
param groups carry torch's names with torch's meaning beside ours (``betas``;
``momentum``/``dampening``/``nesterov``; ``weight_decay``; Adagrad's
``lr_decay`` and ``eps``), kept consistent: a write through either name takes
effect at the next step, a contradiction is a ``ValueError`` naming both and
changes nothing.  torch schedulers that cycle momentum (``OneCycleLR``,
``CyclicLR``) and ``ReduceLROnPlateau`` therefore work.  Constructors accept
torch's keywords where the meaning is identical; ONNX/DirectML Adam's ``eps``
(placed differently) is a ``TypeError`` naming ``epsilon`` and the difference.

References: torch.optim itself (twins written by hand with torch's keywords,
``foreach=False``), or the same optimizer of ours driven through our names.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from tolerances import TORCH_ADAM_FLOAT32, assert_close
from _frameworks import torch_add_param_group
from torch import nn
from torch.optim.lr_scheduler import CyclicLR, OneCycleLR, ReduceLROnPlateau

import dml_optim

SHAPES = [(5,), (3, 4), (2, 2, 3)]


def _params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def _targets(n, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=dtype) for s in SHAPES] for _ in range(n)]


def _set_grads(params, targets):
    """A convex loss: grad = p - target (same gradients for twins with equal parameters)."""
    for p, t in zip(params, targets):
        p.grad = (p.detach() - t).clone()


@dataclass(frozen=True)
class Twin:
    id: str
    ours: Callable[..., torch.optim.Optimizer]
    theirs: Callable[..., torch.optim.Optimizer]
    dtype: torch.dtype = torch.float64

    @property
    def tol(self) -> dict:
        # DmlAdam takes float32 only; torch.optim.Adam computes the bias correction in another
        # order (tests/tolerances.py: observed max 4e-7 relative over 50 steps)
        return TORCH_ADAM_FLOAT32 if self.dtype == torch.float32 else {}


TWINS = [
    Twin("adam", lambda ps, lr=1e-2: dml_optim.Adam(ps, lr=lr, alpha=0.9, beta=0.99, epsilon=0.0, norm_coefficient=0.01),
         lambda ps, lr=1e-2: torch.optim.Adam(ps, lr=lr, betas=(0.9, 0.99), eps=0.0, weight_decay=0.01, foreach=False)),
    Twin("dml-adam", lambda ps, lr=1e-2: dml_optim.DmlAdam(ps, lr=lr, beta1=0.9, beta2=0.99, epsilon=0.0),
         lambda ps, lr=1e-2: torch.optim.Adam(ps, lr=lr, betas=(0.9, 0.99), eps=0.0, foreach=False), torch.float32),
    Twin("adamw", lambda ps, lr=1e-2: dml_optim.AdamW(ps, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05),
         lambda ps, lr=1e-2: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)),
    Twin("momentum", lambda ps, lr=1e-2: dml_optim.Momentum(ps, lr=lr, alpha=0.9, beta=0.7, norm_coefficient=0.01),
         lambda ps, lr=1e-2: torch.optim.SGD(ps, lr=lr, momentum=0.9, dampening=0.3, weight_decay=0.01, foreach=False)),
    Twin("adagrad", lambda ps, lr=1e-2: dml_optim.Adagrad(ps, lr=lr, decay_factor=0.01, epsilon=1e-10, norm_coefficient=0.01),
         lambda ps, lr=1e-2: torch.optim.Adagrad(ps, lr=lr, lr_decay=0.01, eps=1e-10, weight_decay=0.01, foreach=False)),
]
BY_ID = {t.id: t for t in TWINS}
CYCLING = [t for t in TWINS if t.id != "adagrad"]


def _momentum_key(opt) -> str:
    return "betas" if "betas" in opt.defaults else "momentum"


def _run_side_by_side(twin: Twin, make_sched: Callable, steps: int, metric=None):
    ps = _params(twin.dtype)
    ts = _clone(ps)
    opt, topt = twin.ours(ps), twin.theirs(ts)
    sched, tsched = make_sched(opt), make_sched(topt)
    targets = _targets(steps, twin.dtype)
    for k in range(steps):
        _set_grads(ps, targets[k])
        _set_grads(ts, targets[k])
        opt.step()
        topt.step()
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach(), **twin.tol)
        if metric is None:
            sched.step()
            tsched.step()
        else:
            sched.step(metric[k])
            tsched.step(metric[k])
        g, tg = opt.param_groups[0], topt.param_groups[0]
        assert g["lr"] == tg["lr"], k
        if "betas" in tg or "momentum" in tg:
            key = "betas" if "betas" in tg else "momentum"
            assert g[key] == tg[key], (k, g[key], tg[key])
    return opt, topt


# -- schedulers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", CYCLING, ids=[t.id for t in CYCLING])
def test_one_cycle_lr_with_cycle_momentum_equals_torch(twin):
    """OneCycleLR with its defaults (cycle_momentum=True: it cycles ``betas[0]`` or ``momentum``)."""
    opt, _ = _run_side_by_side(twin, lambda o: OneCycleLR(o, max_lr=1e-2, total_steps=25), 24)
    g = opt.param_groups[0]
    # the cycled torch name reached our spec name at the steps (the scheduler really moved it)
    spec = {"adam": "alpha", "dml-adam": "beta1", "adamw": "beta1", "momentum": "alpha"}[twin.id]
    assert g[spec] != 0.9


@pytest.mark.parametrize("twin", CYCLING, ids=[t.id for t in CYCLING])
def test_cyclic_lr_with_cycle_momentum_equals_torch(twin):
    """CyclicLR with its defaults (triangular, cycle_momentum=True, momentum 0.8..0.9)."""
    _run_side_by_side(twin, lambda o: CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=5), 24)


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_adagrad_refuses_cycle_momentum_like_torch(scheduler):
    """Adagrad has no momentum: the scheduler raises the same ValueError for ours as for torch's."""
    make = {"OneCycleLR": lambda o: OneCycleLR(o, max_lr=1e-2, total_steps=10),
            "CyclicLR": lambda o: CyclicLR(o, base_lr=1e-3, max_lr=1e-2)}[scheduler]
    with pytest.raises(ValueError) as theirs:
        make(torch.optim.Adagrad(_params()))
    with pytest.raises(ValueError) as ours:
        make(dml_optim.Adagrad(_params()))
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("twin", TWINS, ids=[t.id for t in TWINS])
def test_reduce_lr_on_plateau_equals_torch(twin):
    metric = [1.0, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
    _, topt = _run_side_by_side(twin, lambda o: ReduceLROnPlateau(o, factor=0.5, patience=1), len(metric), metric)
    assert topt.param_groups[0]["lr"] < 1e-2  # the plateau did lower the rate


# -- writes through torch names ----------------------------------------------------------------------


#: (twin, torch-name write, the same write in our names)
WRITES = [
    ("adam", {"betas": (0.5, 0.9)}, {"alpha": 0.5, "beta": 0.9}),
    ("adam", {"weight_decay": 0.2}, {"norm_coefficient": 0.2}),
    ("dml-adam", {"betas": (0.5, 0.9)}, {"beta1": 0.5, "beta2": 0.9}),
    ("adamw", {"betas": (0.5, 0.9)}, {"beta1": 0.5, "beta2": 0.9}),
    ("adagrad", {"lr_decay": 0.5}, {"decay_factor": 0.5}),
    ("adagrad", {"eps": 0.1}, {"epsilon": 0.1}),
    ("adagrad", {"weight_decay": 0.2}, {"norm_coefficient": 0.2}),
    ("momentum", {"momentum": 0.5}, {"alpha": 0.5}),
    ("momentum", {"dampening": 0.5}, {"beta": 0.5}),
    ("momentum", {"weight_decay": 0.2}, {"norm_coefficient": 0.2}),
    ("momentum-nesterov", {"nesterov": True}, {"mode": "nesterov"}),
]


def _twin_for(name: str) -> Twin:
    if name == "momentum-nesterov":  # torch's nesterov needs zero dampening (beta = 1)
        return Twin(name, lambda ps: dml_optim.Momentum(ps, lr=1e-2, alpha=0.9, beta=1.0),
                    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False))
    return BY_ID[name]


@pytest.mark.parametrize("name,torch_write,spec_write", WRITES,
                         ids=[f"{n}-{next(iter(w))}" for n, w, _ in WRITES])
def test_write_through_torch_name_takes_effect_at_next_step(name, torch_write, spec_write):
    """After 2 steps, one optimizer gets the write through torch's name, a second through ours, a
    third nothing, and torch.optim gets torch's write: the next 2 steps are bit-identical between
    the first two, equal to torch.optim's, and differ from the unchanged one; both names then read
    the new value."""
    twin = _twin_for(name)
    base = _params(twin.dtype)
    ps_a, ps_b, ps_c, ts = _clone(base), _clone(base), _clone(base), _clone(base)
    a, b, c, t = twin.ours(ps_a), twin.ours(ps_b), twin.ours(ps_c), twin.theirs(ts)
    targets = _targets(4, twin.dtype)
    for k in range(4):
        if k == 2:
            a.param_groups[0].update(torch_write)
            b.param_groups[0].update(spec_write)
            t.param_groups[0].update(torch_write)
        for params, o in ((ps_a, a), (ps_b, b), (ps_c, c), (ts, t)):
            _set_grads(params, targets[k])
            o.step()
    for pa, pb, pc, pt in zip(ps_a, ps_b, ps_c, ts):
        assert torch.equal(pa, pb)
        assert_close(pa.detach(), pt.detach(), **twin.tol)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(ps_a, ps_c)), "the write changed nothing"
    for o in (a, b):
        g = o.param_groups[0]
        for key, value in {**torch_write, **spec_write}.items():
            assert g[key] == value, (key, g[key], value)


#: (twin, torch-name write, contradicting write in our names, the two keys the message must name)
CONTRADICTIONS = [
    ("adam", {"betas": (0.5, 0.9), "alpha": 0.7}, ("betas", "alpha")),
    ("dml-adam", {"betas": (0.5, 0.9), "beta2": 0.95}, ("betas", "beta2")),
    ("adamw", {"betas": (0.5, 0.9), "beta1": 0.7}, ("betas", "beta1")),
    ("adagrad", {"eps": 0.1, "epsilon": 0.2}, ("eps", "epsilon")),
    ("adagrad", {"lr_decay": 0.1, "decay_factor": 0.2}, ("lr_decay", "decay_factor")),
    ("momentum", {"momentum": 0.5, "alpha": 0.7}, ("momentum", "alpha")),
    ("momentum", {"dampening": 0.5, "beta": 0.6}, ("dampening", "beta")),
    ("adam", {"weight_decay": 0.1, "norm_coefficient": 0.2}, ("weight_decay", "norm_coefficient")),
]


@pytest.mark.parametrize("name,write,keys", CONTRADICTIONS, ids=[f"{n}-{k[0]}-{k[1]}" for n, _, k in CONTRADICTIONS])
def test_contradicting_names_raise_naming_both_and_change_nothing(name, write, keys):
    twin = BY_ID[name]
    ps = _params(twin.dtype)
    opt = twin.ours(ps)
    targets = _targets(3, twin.dtype)
    for k in range(2):
        _set_grads(ps, targets[k])
        opt.step()
    _set_grads(ps, targets[2])
    params_before = [p.detach().clone() for p in ps]
    (info,) = opt.flat_buffers()  # reads the flat states without re-syncing the group
    states_before = {n: t.clone() for n, t in info.states.items()}
    group_before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    opt.param_groups[0].update(write)
    with pytest.raises(ValueError) as err:
        opt.step()
    message = str(err.value)
    for key in keys:
        assert re.search(rf"\b{key}\b", message), (key, message)
    for p, before in zip(ps, params_before):
        assert torch.equal(p, before)
    (info,) = opt.flat_buffers()
    assert info.step_counts == (2,) * len(ps)
    assert set(info.states) == set(states_before)
    for n, t in states_before.items():
        assert torch.equal(info.states[n], t), n
    # the settings the last step used are untouched apart from the two keys written
    for k, v in group_before.items():
        if k not in write:
            assert opt.param_groups[0][k] == v, k


def test_agreeing_writes_through_both_names_are_accepted():
    ps = _params()
    opt = BY_ID["adam"].ours(ps)
    _set_grads(ps, _targets(1, torch.float64)[0])
    opt.step()
    opt.param_groups[0].update(betas=(0.5, 0.9), alpha=0.5, beta=0.9)
    opt.step()
    assert opt.param_groups[0]["alpha"] == 0.5 and opt.param_groups[0]["betas"] == (0.5, 0.9)


# -- constructors ----------------------------------------------------------------------------------------


#: (class, torch keywords, the same in our keywords)
CONSTRUCTORS = [
    ("Adam", dict(lr=1e-3, betas=(0.8, 0.99), weight_decay=0.01), dict(lr=1e-3, alpha=0.8, beta=0.99, norm_coefficient=0.01)),
    ("DmlAdam", dict(lr=1e-3, betas=(0.8, 0.99)), dict(lr=1e-3, beta1=0.8, beta2=0.99)),
    ("Adagrad", dict(lr=1e-2, lr_decay=0.1, eps=1e-3, weight_decay=0.01),
     dict(lr=1e-2, decay_factor=0.1, epsilon=1e-3, norm_coefficient=0.01)),
    ("Momentum", dict(lr=1e-2, momentum=0.8, dampening=0.25, weight_decay=0.01),
     dict(lr=1e-2, alpha=0.8, beta=0.75, norm_coefficient=0.01)),
    ("Momentum", dict(lr=1e-2, momentum=0.8, nesterov=True), dict(lr=1e-2, alpha=0.8, mode="nesterov")),
]


@pytest.mark.parametrize("cls,torch_kw,spec_kw", CONSTRUCTORS,
                         ids=[f"{c}-{'-'.join(k for k in t if k != 'lr')}" for c, t, _ in CONSTRUCTORS])
def test_constructor_accepts_torch_keywords_with_identical_results(cls, torch_kw, spec_kw):
    cls = getattr(dml_optim, cls)
    dtype = torch.float32 if cls is dml_optim.DmlAdam else torch.float64
    base = _params(dtype)
    ps_a, ps_b = _clone(base), _clone(base)
    a, b = cls(ps_a, **torch_kw), cls(ps_b, **spec_kw)
    assert {k: v for k, v in a.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in b.param_groups[0].items() if k != "params"}
    for tg in _targets(4, dtype):
        _set_grads(ps_a, tg)
        _set_grads(ps_b, tg)
        a.step()
        b.step()
    for pa, pb in zip(ps_a, ps_b):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("cls", ["Adam", "DmlAdam"])
def test_constructor_refuses_eps_naming_epsilon_and_the_difference(cls):
    with pytest.raises(TypeError) as err:
        getattr(dml_optim, cls)(_params(torch.float32), lr=1e-3, eps=1e-8)
    message = str(err.value)
    assert "eps=" in message
    assert re.search(r"\bepsilon\b", message), message
    assert "bias correction" in message, message  # what differs: where epsilon is added


@pytest.mark.parametrize("cls,kwargs,keys", [
    ("Adam", dict(betas=(0.8, 0.999), alpha=0.7), ("betas", "alpha")),
    ("Adam", dict(betas=(0.9, 0.95), beta=0.99), ("betas", "beta")),
    ("Adam", dict(weight_decay=0.1, norm_coefficient=0.2), ("weight_decay", "norm_coefficient")),
    ("DmlAdam", dict(betas=(0.8, 0.999), beta1=0.7), ("betas", "beta1")),
    ("Momentum", dict(lr=0.1, momentum=0.5, alpha=0.7), ("momentum", "alpha")),
    ("Adagrad", dict(eps=0.1, epsilon=0.2), ("eps", "epsilon")),
])
def test_constructor_conflict_is_a_type_error_naming_both(cls, kwargs, keys):
    with pytest.raises(TypeError) as err:
        getattr(dml_optim, cls)(_params(torch.float32), **kwargs)
    for key in keys:
        assert re.search(rf"\b{key}\b", str(err.value)), (key, str(err.value))


# -- add_param_group ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,extra", [
    ("adam", {"betas": (0.5, 0.9), "weight_decay": 0.1}),
    ("momentum", {"momentum": 0.5, "dampening": 0.2, "weight_decay": 0.1}),
    ("adagrad", {"lr_decay": 0.1, "eps": 1e-3, "weight_decay": 0.1}),
    ("adamw", {"betas": (0.5, 0.9)}),
])
def test_add_param_group_with_torch_names_only(name, extra):
    """A group added with torch's names only gets them in ours too and steps like torch.optim's
    group added with the same dict."""
    twin = BY_ID[name]
    base = _params()
    ps, ts = _clone(base), _clone(base)
    opt, topt = twin.ours(ps[:1]), twin.theirs(ts[:1])
    opt.add_param_group({"params": ps[1:], "lr": 2e-2, **extra})
    torch_add_param_group(topt, {"params": ts[1:], "lr": 2e-2, **extra})
    g = opt.param_groups[1]
    for key, value in extra.items():
        assert g[key] == value
    spec = type(opt).spec
    for alias in spec.torch.aliases:
        if alias.torch in extra:
            derived = alias.from_torch(extra[alias.torch])
            assert tuple(g[n] for n in alias.ours) == tuple(float(v) if not isinstance(v, str) else v for v in derived)
    for tg in _targets(5, torch.float64):
        _set_grads(ps, tg)
        _set_grads(ts, tg)
        opt.step()
        topt.step()
    for p, t in zip(ps, ts):
        assert_close(p.detach(), t.detach())


# -- state dicts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,names", [
    ("adam", ("alpha", "beta", "betas", "norm_coefficient", "weight_decay")),
    ("dml-adam", ("beta1", "beta2", "betas")),
    ("adamw", ("beta1", "beta2", "betas", "weight_decay", "eps")),
    ("adagrad", ("decay_factor", "lr_decay", "epsilon", "eps", "norm_coefficient", "weight_decay")),
    ("momentum", ("alpha", "momentum", "beta", "dampening", "mode", "nesterov", "norm_coefficient", "weight_decay")),
])
def test_state_dict_param_groups_hold_both_names(name, names):
    twin = BY_ID[name]
    ps = _params(twin.dtype)
    opt = twin.ours(ps)
    _set_grads(ps, _targets(1, twin.dtype)[0])
    opt.step()
    g = opt.state_dict()["param_groups"][0]
    for key in names:
        assert key in g, key
    t = twin.theirs(_clone(ps)).state_dict()["param_groups"][0]
    for key in names:
        if key in t:  # the torch names carry torch's values for the same configuration
            # (to the last bit but one: dampening is stored as 1 - beta, 1 - 0.7 = 0.30000000000000004)
            assert g[key] == pytest.approx(t[key], rel=1e-15, abs=1e-16), (key, g[key], t[key])


def test_state_dict_right_after_a_torch_name_write_is_consistent():
    """A write through torch's name, then a checkpoint before the next step (the usual
    ``opt.step(); sched.step(); save``): the saved group must not contradict itself."""
    ps = _params()
    opt = BY_ID["adam"].ours(ps)
    _set_grads(ps, _targets(1, torch.float64)[0])
    opt.step()
    opt.param_groups[0]["betas"] = (0.5, 0.9)
    g = opt.state_dict()["param_groups"][0]
    assert (g["alpha"], g["beta"]) == tuple(g["betas"]) == (0.5, 0.9), g


@pytest.mark.parametrize("twin", CYCLING, ids=[t.id for t in CYCLING])
def test_checkpoint_mid_one_cycle_resumes_like_torch(twin):
    """Save optimizer and scheduler after ``opt.step(); sched.step()`` in the middle of a OneCycleLR
    run, load both into fresh ones, go on: equal to torch.optim's uninterrupted run."""
    steps, cut = 20, 8
    ps = _params(twin.dtype)
    ts = _clone(ps)
    opt, topt = twin.ours(ps), twin.theirs(ts)
    sched = OneCycleLR(opt, max_lr=1e-2, total_steps=steps)
    tsched = OneCycleLR(topt, max_lr=1e-2, total_steps=steps)
    targets = _targets(steps, twin.dtype)
    for k in range(cut):
        for params, o, s in ((ps, opt, sched), (ts, topt, tsched)):
            _set_grads(params, targets[k])
            o.step()
            s.step()
    sd, ssd = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    rs = _clone(ps)
    ropt = twin.ours(rs)
    rsched = OneCycleLR(ropt, max_lr=1e-2, total_steps=steps)
    ropt.load_state_dict(sd)
    rsched.load_state_dict(ssd)
    for k in range(cut, steps - 1):
        for params, o, s in ((rs, ropt, rsched), (ts, topt, tsched)):
            _set_grads(params, targets[k])
            o.step()
            s.step()
        for r, t in zip(rs, ts):
            assert_close(r.detach(), t.detach(), **twin.tol)


@pytest.mark.parametrize("twin", TWINS, ids=[t.id for t in TWINS])
def test_torch_state_dict_with_its_names_loads_and_continues_equal(twin):
    """torch.optim trained 4 steps with *other* hyperparameters than ours was built with (its names:
    betas/momentum/dampening/lr_decay/...); its state dict loaded into ours continues equal."""
    torch_other = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=5e-3, betas=(0.7, 0.95), eps=0.0, weight_decay=0.02, foreach=False),
        "dml-adam": lambda ps: torch.optim.Adam(ps, lr=5e-3, betas=(0.7, 0.95), eps=0.0, foreach=False),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=5e-3, betas=(0.7, 0.95), eps=1e-6, weight_decay=0.02, foreach=False),
        "momentum": lambda ps: torch.optim.SGD(ps, lr=5e-3, momentum=0.7, dampening=0.1, weight_decay=0.02, foreach=False),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-3, lr_decay=0.1, eps=1e-6, weight_decay=0.02, foreach=False),
    }[twin.id]
    ts = _params(twin.dtype)
    topt = torch_other(ts)
    targets = _targets(8, twin.dtype)
    for k in range(4):
        _set_grads(ts, targets[k])
        topt.step()
    ps = _clone(ts)
    opt = twin.ours(ps)
    opt.load_state_dict(copy.deepcopy(topt.state_dict()))
    g, tg = opt.param_groups[0], topt.param_groups[0]
    for key in ("lr", "betas", "momentum", "dampening", "weight_decay", "lr_decay"):
        if key in tg and key in g:  # (dampening goes through beta = 1 - dampening: 0.1 reads 0.09999999999999998)
            assert g[key] == pytest.approx(tg[key], rel=1e-15, abs=1e-16), (key, g[key], tg[key])
    for k in range(4, 8):
        _set_grads(ps, targets[k])
        _set_grads(ts, targets[k])
        opt.step()
        topt.step()
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach(), **twin.tol)
