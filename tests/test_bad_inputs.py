"""The bad-input catalogue (issue 8, item 1), as data.

Every entry builds a small world (parameters with gradients and, usually, an
optimizer that has already taken a step), optionally spoils it (``prepare``),
snapshots it, performs one action that must fail (``act``), and checks:

* the exception type,
* a message naming the argument and the offending value (``match``),
* parameters, gradients, optimizer state (``state_dict()`` deep-copied, step
  counters, host and device) and the param groups are bit-identical afterwards.

Modelled on torch.optim's ``optim_error_inputs_func_*`` and
``get_error_inputs_for_all_optims`` (torch/testing/_internal/common_optimizers.py):
a Tensor instead of an iterable, duplicate parameters across groups (within a
group torch warns and so do we: tests/test_torch_contract.py), a 2-element
tensor lr, named and unnamed parameters mixed, out-of-range betas / momentum /
lr_decay / weight_decay, and the torch names' analogues for each of our
optimizers.

The optimizers and the valid interval of each float hyperparameter come from
the test matrix (``tests/matrix.py``: ``Entry.intervals``), so a new optimizer
is in the catalogue as soon as it has a matrix entry.  The catalogue runs in
float32 on the CPU (its messages name float32; its second device is meta).

Two devices in one group are simulated with ``cpu`` and ``meta`` (meta tensors
have a device and a shape but no data; the device check happens before any
data is touched, so this works).  A gradient on another device cannot be
assigned through ``p.grad = ...`` (autograd refuses it), so that case uses a
``Parameter`` subclass whose ``grad`` property returns a planted tensor.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from dml_optim import Adam
from dml_optim.core.quant import QuantizedState
from dml_optim.optimizers import registry
from matrix import ENTRIES, cases

#: The optimizers of the test matrix (tests/matrix.py), each in float32 on the CPU: the catalogue's
#: messages name float32 (e.g. a float64 gradient is the wrong dtype) and its second device is "meta".
OPTIMIZERS = {p.values[0].name: p.values[0] for p in cases(dtypes=(torch.float32,), devices=("cpu",))}


# ---------------------------------------------------------------------------
# the world, its snapshot, and bit-exact comparison
# ---------------------------------------------------------------------------


@dataclass
class World:
    cls: type
    params: list
    opt: Any = None
    scratch: dict = field(default_factory=dict)  # what prepare() built for act()


def make_params(shapes=((2, 3), (4,), (5,)), dtype=torch.float32, device="cpu", grads=True):
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)) for s in shapes]
    if grads:
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    return ps


def new_grads(params, seed=2):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype=p.dtype, device=p.device)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


#: Hyperparameters a world's optimizer gets beyond lr: torch.optim.SGD's default keeps no state to spoil.
WORLD_HYPER = {"sgd": dict(momentum=0.9)}


def two_group_world(cls, **kw) -> World:
    """Two groups ([p0, p1] and [p2]), one completed step, fresh gradients."""
    ps = make_params()
    kw = {**WORLD_HYPER.get(registry.name_of(cls), {}), **kw}
    opt = cls([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}], lr=0.1, **kw)
    opt.step()
    new_grads(ps)
    return World(cls, ps, opt)


def fresh_world(cls) -> World:
    """Parameters with gradients and no optimizer (construction cases)."""
    return World(cls, make_params())


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def snapshot(params, opt=None) -> dict:
    """Everything a failed call must leave untouched, deep-copied."""
    snap = {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
    }
    if opt is not None:
        snap["state_dict"] = _clone(opt.state_dict())
        infos = opt.flat_buffers()
        snap["n_groups"] = (len(opt.param_groups), len(infos))
        snap["groups"] = [{k: _clone(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        snap["group_params"] = [[id(p) for p in g["params"]] for g in opt.param_groups]
        # the step counts in effect (host or device counters), per parameter of each buffer
        snap["steps"] = [(i.param_indices, list(i.step_counts)) for i in infos]
        # flat state buffers are allocated lazily; before any counted step they hold nothing observable
        snap["states"] = [{k: v.clone() for k, v in i.states.items()} if any(i.step_counts) else None for i in infos]
        snap["master"] = [None if i.master is None else i.master.clone() for i in infos]
    return snap


def assert_same(a, b, path="snapshot"):
    """Bit-exact equality of nested snapshots (NaN equals NaN, dtypes must match)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        if a.device.type != "meta":
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{path}: {m}")
        return
    if isinstance(a, QuantizedState) or isinstance(b, QuantizedState):  # a quantized flat state: codes and scales
        assert type(a) is type(b) and a.format == b.format, f"{path}: {a!r} != {b!r}"
        assert_same(a.codes, b.codes, f"{path}.codes")
        assert_same(a.scales, b.scales, f"{path}.scales")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
        return
    if isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[type], World]
    act: Callable[[World], Any]
    exc: type
    match: str
    prepare: Callable[[World], None] = lambda w: None
    #: registry names (tests/matrix.py); default: every optimizer of the matrix
    optimizers: tuple = tuple(ENTRIES)
    #: a known defect: the case is a strict xfail with this reason (it fails the suite once fixed)
    known_gap: str | None = None


def _construct(cls, params, kw):
    """``cls`` over ``params`` with our hyperparameter names (``beta1`` reaches AdamW as ``betas``)."""
    return registry.build(registry.name_of(cls), params, **{"lr": 0.1, **kw})


def construct(**kw):
    """act: construct the optimizer from the world's params with ``kw``."""
    return lambda w: _construct(w.cls, w.params, kw)


def construct_with(params_fn, **kw):
    return lambda w: _construct(w.cls, params_fn(w), kw)


def step(w):
    return w.opt.step()


def _bad_values(low, high, high_open):
    """(value, exception, regex for the value in the message)."""
    out = [(-0.5, ValueError, r"-0\.5")] if low is not None else []
    out += [(float("nan"), ValueError, "nan"), (float("inf"), ValueError, "inf"),
            (float("-inf"), ValueError, "-inf"), ("0.1", TypeError, r"'0\.1'"), (True, TypeError, "True"),
            (None, TypeError, "None"), ([0.1], TypeError, r"\[0\.1\]"),
            # torch.optim's type for "Tensor lr must be 1-element"
            (torch.tensor([0.1, 0.2]), ValueError, r"tensor of shape \(2,\)")]
    if high is not None:
        out.append((1.0, ValueError, r"1\.0") if high_open else (1.5, ValueError, r"1\.5"))
        out.append((2.0, ValueError, r"2\.0"))
    return out


def _fmt(v):
    return v if isinstance(v, (str, type(None), bool, list)) else ("tensor2" if isinstance(v, torch.Tensor) else repr(v))


def hyperparameter_cases() -> list[Case]:
    """Every float hyperparameter of every matrix entry (its ``intervals``), at construction and in a group."""
    cases = []
    for e in ENTRIES.values():
        cls = e.cls
        for name, low, high, high_open in e.intervals:
            for value, exc, vre in _bad_values(low, high, high_open):
                rx = rf"\b{re.escape(name)}\b.*{vre}"
                cases.append(Case(f"{cls.__name__}-init-{name}={_fmt(value)}", fresh_world,
                                  construct(**{name: value}), exc, rx, optimizers=(e.name,)))
                cases.append(Case(f"{cls.__name__}-group1-{name}={_fmt(value)}-then-step", two_group_world, step, exc, rx,
                                  prepare=lambda w, n=name, v=value: w.opt.param_groups[1].__setitem__(n, v),
                                  optimizers=(e.name,)))
    for which in ("init", "group1"):
        if which == "init":
            cases.append(Case("Momentum-init-mode=adam", fresh_world, construct(mode="adam"), ValueError,
                              r"mode.*'adam'", optimizers=("momentum",)))
        else:
            cases.append(Case("Momentum-group1-mode=adam-then-step", two_group_world, step, ValueError, r"mode.*'adam'",
                              prepare=lambda w: w.opt.param_groups[1].__setitem__("mode", "adam"),
                              optimizers=("momentum",)))
    return cases


def _set_group1(key, value):
    return lambda w: w.opt.param_groups[1].__setitem__(key, value)


OPTION_CASES = [
    Case("init-backend=cuda", fresh_world, construct(backend="cuda"), ValueError, r"backend.*'cuda'"),
    Case("init-nonfinite=ignore", fresh_world, construct(nonfinite="ignore"), ValueError, r"nonfinite.*'ignore'"),
    Case("init-nonfinite=None", fresh_world, construct(nonfinite=None), ValueError, r"nonfinite.*None"),
    Case("init-state_dtype=int32", fresh_world, construct(state_dtype=torch.int32), ValueError, r"state_dtype.*int32"),
    Case("init-state_dtype='half-ish'", fresh_world, construct(state_dtype="halfish"), ValueError, r"state_dtype.*'halfish'"),
    Case("init-compute_dtype=complex64", fresh_world, construct(compute_dtype=torch.complex64), ValueError,
         r"compute_dtype.*complex64"),
    Case("init-master_weights='yes'", fresh_world, construct(master_weights="yes"), TypeError, r"master_weights.*'yes'"),
    Case("init-master_weights-on-float32", fresh_world, construct(master_weights=True), ValueError,
         r"master_weights.*float32"),
    Case("init-atomic=1", fresh_world, construct(atomic=1), TypeError, r"atomic.*1"),
    Case("group1-backend=cuda-then-step", two_group_world, step, ValueError, r"backend.*'cuda'",
         prepare=_set_group1("backend", "cuda")),
    Case("group1-nonfinite=ignore-then-step", two_group_world, step, ValueError, r"nonfinite.*'ignore'",
         prepare=_set_group1("nonfinite", "ignore")),
    Case("group1-state_dtype=int8-then-step", two_group_world, step, ValueError, r"state_dtype.*int8",
         prepare=_set_group1("state_dtype", "int8")),
    Case("group1-master_weights-on-float32-then-step", two_group_world, step, ValueError, r"master_weights.*float32",
         prepare=_set_group1("master_weights", True)),
]


# -- parameters ----------------------------------------------------------------


def _meta_param(shape=(3,)):
    return torch.nn.Parameter(torch.empty(shape, device="meta"))


PARAM_CASES = [
    Case("params-a-tensor", fresh_world, construct_with(lambda w: w.params[0]), TypeError,
         r"params.*iterable.*got a Tensor"),
    Case("params-int64", fresh_world, construct_with(lambda w: [w.params[0], torch.zeros(3, dtype=torch.int64)]),
         TypeError, r"params.*\['params'\]\[1\].*floating point.*int64"),
    Case("params-bool", fresh_world, construct_with(lambda w: [torch.zeros(3, dtype=torch.bool)]), TypeError,
         r"params.*\['params'\]\[0\].*floating point.*bool"),
    Case("params-not-leaf", fresh_world, construct_with(lambda w: [w.params[0], w.params[1] * 2]), ValueError,
         r"params.*\['params'\]\[1\].*not a leaf"),
    Case("params-complex", fresh_world,
         construct_with(lambda w: [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]), TypeError,
         r"params.*\['params'\]\[0\].*complex.*complex64.*view_as_real"),
    Case("params-sparse", fresh_world, construct_with(lambda w: [torch.nn.Parameter(torch.eye(2).to_sparse())]),
         TypeError, r"params.*\['params'\]\[0\].*sparse"),
    Case("params-duplicate-across-groups", fresh_world,
         construct_with(lambda w: [{"params": [w.params[0]]}, {"params": [w.params[1], w.params[0]]}]), ValueError,
         r"params: some parameters appear in more than one parameter group \(param_groups\[1\]\['params'\]\[1\]"),
    Case("params-set-in-group", fresh_world, construct_with(lambda w: [{"params": {w.params[0]}}]), TypeError,
         r"params.*ordered.*got a set"),
    Case("params-empty", fresh_world, construct_with(lambda w: []), ValueError, r"empty parameter list"),
    Case("params-named-and-unnamed", fresh_world, construct_with(lambda w: [("weight", w.params[0]), w.params[1]]),
         ValueError, r"params: param_groups\[0\]: all optimizer params should be with/without names.*\['params'\]\[1\]"),
    Case("params-named-group-after-unnamed", fresh_world,
         construct_with(lambda w: [{"params": [w.params[0]]}, {"params": [("b", w.params[1])]}]), ValueError,
         r"params: param_groups\[1\]: all optimizer param groups should be with/without names"),
    Case("params-an-int", fresh_world, construct_with(lambda w: [w.params[0], 3]), TypeError,
         r"params.*\['params'\]\[1\].*must be a Tensor, got int"),
    Case("params-group-not-dict", fresh_world, construct_with(lambda w: [[w.params[0]]]), TypeError,
         r"params.*must be a Tensor, got list"),
    Case("DmlAdam-params-float64", fresh_world,
         construct_with(lambda w: [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]), TypeError,
         r"params.*\['params'\]\[0\].*float64.*FLOAT32 or FLOAT16", optimizers=("dml-adam",)),
    Case("DmlAdam-params-bfloat16", fresh_world,
         construct_with(lambda w: [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]), TypeError,
         r"params.*\['params'\]\[0\].*bfloat16", optimizers=("dml-adam",)),
    # add_param_group on a live optimizer: nothing changes, not even the number of groups
    Case("add_param_group-duplicate", two_group_world, lambda w: w.opt.add_param_group({"params": [w.params[1]]}),
         ValueError, r"params: some parameters appear in more than one parameter group \(param_groups\[2\]\['params'\]\[0\]"),
    Case("add_param_group-int", two_group_world,
         lambda w: w.opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int32)]}), TypeError,
         r"params.*param_groups\[2\]\['params'\]\[0\].*int32"),
    Case("add_param_group-bad-lr", two_group_world,
         lambda w: w.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -3.0}), ValueError,
         r"\blr\b.*-3\.0"),
    Case("add_param_group-not-dict", two_group_world, lambda w: w.opt.add_param_group([torch.zeros(2)]), TypeError,
         r"param_group must be a dict, got list"),
]


# -- gradients at step() --------------------------------------------------------

_TENSOR_GRAD = torch._C.TensorBase.grad


class PlantedGradParam(torch.nn.Parameter):
    """A Parameter whose ``grad`` can be replaced by any tensor (autograd would refuse some)."""

    planted = None

    @property
    def grad(self):
        return self.planted if self.planted is not None else _TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value):
        self.planted = None
        _TENSOR_GRAD.__set__(self, value)


def force_grad(p, g):
    """Give ``p`` a gradient of another shape or dtype (``p.grad = g`` is refused by autograd)."""
    saved = p.data
    p.data = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    p.grad = g
    p.data = saved


def planted_world(cls) -> World:
    ps = make_params(grads=False)
    ps[2] = PlantedGradParam(ps[2].detach())
    new_grads(ps, seed=1)
    opt = cls([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}], lr=0.1)
    opt.step()
    new_grads(ps)
    return World(cls, ps, opt)


GRAD_CASES = [
    Case("grad-wrong-shape", two_group_world, step, ValueError,
         r"grad of param_groups\[1\]\['params'\]\[0\] \(shape \(5,\).*has shape \(5, 1\)",
         prepare=lambda w: force_grad(w.params[2], torch.ones(5, 1))),
    Case("grad-wrong-dtype", two_group_world, step, TypeError,
         r"grad of param_groups\[1\]\['params'\]\[0\].*float32.*has dtype torch.float64",
         prepare=lambda w: force_grad(w.params[2], torch.ones(5, dtype=torch.float64))),
    Case("grad-wrong-device", planted_world, step, ValueError,
         r"grad of param_groups\[1\]\['params'\]\[0\].*cpu\).* is on meta",
         prepare=lambda w: setattr(w.params[2], "planted", torch.ones(5, device="meta"))),
    Case("grad-sparse", two_group_world, step, TypeError, r"grad of param_groups\[1\]\['params'\]\[0\].*sparse",
         prepare=lambda w: setattr(w.params[2], "grad", torch.ones(5).to_sparse())),
    Case("grad-sparse-first-group", two_group_world, step, TypeError,
         r"grad of param_groups\[0\]\['params'\]\[1\].*sparse",
         prepare=lambda w: setattr(w.params[1], "grad", torch.ones(4).to_sparse())),
]


# -- load_state_dict ---------------------------------------------------------------


def _sd_mutation(mutate):
    """prepare: build a deep copy of the optimizer's state dict and spoil it."""

    def prepare(w):
        sd = _clone(w.opt.state_dict())
        mutate(sd)
        w.scratch["sd"] = sd

    return prepare


def load(w):
    return w.opt.load_state_dict(w.scratch["sd"])


def _first_state(sd):
    return sd["state"][0]


def _first_state_name(sd):
    return next(k for k in _first_state(sd) if k != "step")


def _replace_state_tensor(fn):
    def mutate(sd):
        name = _first_state_name(sd)
        _first_state(sd)[name] = fn(_first_state(sd)[name])
    return mutate


def _set_step(value):
    return lambda sd: _first_state(sd).__setitem__("step", value)


def _set_version(value):
    return lambda sd: sd["dml_optim"].__setitem__("format_version", value)


def _torch_layout(flag):
    """A torch.optim-layout (version 0) dict with a flag that changes the update rule."""

    def mutate(sd):
        del sd["dml_optim"]
        for g in sd["param_groups"]:
            for key in list(g):
                if key not in ("params", "lr"):
                    del g[key]
            g[flag] = True
    return mutate


_STATE = r"state\[0\] \(param_groups\[0\]\['params'\]\[0\], shape \(2, 3\)\)"

LOAD_CASES = [
    Case("load-not-a-dict", two_group_world, lambda w: w.opt.load_state_dict([("state", {})]), TypeError,
         r"load_state_dict: state_dict must be a dict, got list"),
    Case("load-missing-state", two_group_world, load, KeyError, r"missing keys \['state'\]",
         prepare=_sd_mutation(lambda sd: sd.pop("state"))),
    Case("load-missing-param_groups", two_group_world, load, KeyError, r"missing keys \['param_groups'\]",
         prepare=_sd_mutation(lambda sd: sd.pop("param_groups"))),
    Case("load-extra-top-key", two_group_world, load, KeyError, r"unexpected keys \['scaler'\]",
         prepare=_sd_mutation(lambda sd: sd.__setitem__("scaler", {}))),
    Case("load-missing-state-key", two_group_world, load, KeyError, _STATE + r" is missing keys \['\w+'\]",
         prepare=_sd_mutation(lambda sd: _first_state(sd).pop(_first_state_name(sd)))),
    Case("load-missing-step", two_group_world, load, KeyError, _STATE + r" is missing keys \['step'\]",
         prepare=_sd_mutation(lambda sd: _first_state(sd).pop("step"))),
    Case("load-extra-state-key", two_group_world, load, KeyError, _STATE + r" has unexpected keys \['max_exp_avg_sq'\]",
         prepare=_sd_mutation(lambda sd: _first_state(sd).__setitem__("max_exp_avg_sq", torch.zeros(2, 3)))),
    Case("load-wrong-shape", two_group_world, load, ValueError, _STATE + r"\['\w+'\] has shape \(3, 2\), expected \(2, 3\)",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.reshape(3, 2)))),
    Case("load-flattened-shape", two_group_world, load, ValueError, _STATE + r"\['\w+'\] has shape \(6,\)",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.reshape(-1)))),
    Case("load-integer-state", two_group_world, load, TypeError, _STATE + r"\['\w+'\] has dtype torch.int32",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.to(torch.int32)))),
    Case("load-complex-state", two_group_world, load, TypeError, _STATE + r"\['\w+'\] has dtype torch.complex64",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.to(torch.complex64)))),
    Case("load-sparse-state", two_group_world, load, TypeError, _STATE + r"\['\w+'\] must be a dense tensor.*sparse",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.to_sparse()))),
    Case("load-meta-state", two_group_world, load, ValueError, _STATE + r"\['\w+'\] is on the meta device",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: torch.empty(t.shape, device="meta")))),
    Case("load-state-not-tensor", two_group_world, load, TypeError, _STATE + r"\['\w+'\] must be a tensor, got list",
         prepare=_sd_mutation(_replace_state_tensor(lambda t: t.tolist()))),
    Case("load-fewer-groups", two_group_world, load, ValueError, r"has 1 parameter groups, this optimizer has 2",
         prepare=_sd_mutation(lambda sd: sd["param_groups"].pop())),
    Case("load-more-groups", two_group_world, load, ValueError, r"has 3 parameter groups, this optimizer has 2",
         prepare=_sd_mutation(lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][1])))),
    Case("load-fewer-params", two_group_world, load, ValueError, r"param_groups\[0\] has 1 parameters, this optimizer's has 2",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][0]["params"].pop())),
    Case("load-params-none", two_group_world, load, TypeError, r"param_groups\[0\]\['params'\] must be a list.*None",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][0].__setitem__("params", None))),
    Case("load-duplicate-ids", two_group_world, load, ValueError, r"parameter id 0 appears twice",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][1].__setitem__("params", [0]))),
    Case("load-unlisted-id", two_group_world, load, KeyError, r"parameter id 7, which no param group lists",
         prepare=_sd_mutation(lambda sd: sd["state"].__setitem__(7, sd["state"][0]))),
    Case("load-step-nan", two_group_world, load, ValueError, _STATE + r"\['step'\] must be.*tensor\(nan\)",
         prepare=_sd_mutation(_set_step(torch.tensor(float("nan"))))),
    Case("load-step-inf", two_group_world, load, ValueError, _STATE + r"\['step'\] must be.*inf",
         prepare=_sd_mutation(_set_step(float("inf")))),
    Case("load-step-negative", two_group_world, load, ValueError, _STATE + r"\['step'\] must be.*tensor\(-2\.\)",
         prepare=_sd_mutation(_set_step(torch.tensor(-2.0)))),
    Case("load-step-fraction", two_group_world, load, ValueError, _STATE + r"\['step'\] must be.*2\.5",
         prepare=_sd_mutation(_set_step(2.5))),
    Case("load-step-huge", two_group_world, load, ValueError, _STATE + r"\['step'\] must be.*<= 2\*\*53.*1180591620717411303424",
         prepare=_sd_mutation(_set_step(2**70))),
    Case("DmlAdam-load-step-beyond-uint32", two_group_world, load, ValueError,
         _STATE + r"\['step'\] = 4294967296 is beyond what DmlAdam can have reached \(max 4294967295\)",
         prepare=_sd_mutation(_set_step(2**32)), optimizers=("dml-adam",)),
    Case("load-step-string", two_group_world, load, TypeError, _STATE + r"\['step'\] must be.*'3'",
         prepare=_sd_mutation(_set_step("3"))),
    Case("load-step-vector", two_group_world, load, ValueError, _STATE + r"\['step'\] must be a scalar",
         prepare=_sd_mutation(_set_step(torch.tensor([1.0, 2.0])))),
    Case("load-future-version", two_group_world, load, ValueError, r"format_version 2 is not one this dml_optim reads",
         prepare=_sd_mutation(_set_version(2))),
    Case("load-version-bool", two_group_world, load, ValueError, r"format_version True is not one",
         prepare=_sd_mutation(_set_version(True))),
    Case("load-version-string", two_group_world, load, ValueError, r"format_version '1' is not one",
         prepare=_sd_mutation(_set_version("1"))),
    Case("load-version-missing", two_group_world, load, KeyError, r"'dml_optim' is missing key 'format_version'",
         prepare=_sd_mutation(lambda sd: sd["dml_optim"].pop("format_version"))),
    Case("load-other-optimizer", two_group_world, load, ValueError, r"saved by optimizer 'Sophia'",
         prepare=_sd_mutation(lambda sd: sd["dml_optim"].__setitem__("optimizer", "Sophia"))),
    Case("load-unknown-hyperparameter", two_group_world, load, KeyError,
         r"param_groups\[1\] has unknown hyperparameters \['momentum_decay'\]",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][1].__setitem__("momentum_decay", 0.1))),
    Case("load-missing-hyperparameter", two_group_world, load, KeyError,
         r"param_groups\[1\] is missing hyperparameters \['lr'\]",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][1].pop("lr"))),
    Case("load-bad-lr", two_group_world, load, ValueError, r"param_groups\[1\]: lr must be >= 0, got -1\.0",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][1].__setitem__("lr", -1.0))),
    Case("load-lr-int-beyond-float", two_group_world, load, ValueError, r"param_groups\[1\]: lr = 1000+ is too large",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][1].__setitem__("lr", 10**400))),
    Case("load-bad-nonfinite-option", two_group_world, load, ValueError, r"param_groups\[0\]: nonfinite.*'sometimes'",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][0].__setitem__("nonfinite", "sometimes"))),
    Case("load-bad-state_dtype-option", two_group_world, load, ValueError, r"param_groups\[0\]: state_dtype.*int16",
         prepare=_sd_mutation(lambda sd: sd["param_groups"][0].__setitem__("state_dtype", "int16"))),
    Case("load-torch-maximize", two_group_world, load, ValueError, r"param_groups\[0\] has maximize=True",
         prepare=_sd_mutation(_torch_layout("maximize")),
         optimizers=tuple(n for n, e in ENTRIES.items() if "maximize" not in e.cls.spec.names)),  # AdamW has it
]


CATALOGUE: list[Case] = hyperparameter_cases() + OPTION_CASES + PARAM_CASES + GRAD_CASES + LOAD_CASES

PARAMS = [pytest.param(OPTIMIZERS[name].cls, case, id=f"{OPTIMIZERS[name].cls.__name__}:{case.id}",
                       marks=[pytest.mark.xfail(reason=case.known_gap, strict=True)] if case.known_gap else [])
          for case in CATALOGUE for name in case.optimizers]


def test_catalogue_ids_are_unique():
    ids = [p.id for p in PARAMS]
    assert len(ids) == len(set(ids))
    assert len(PARAMS) > 300  # every optimizer of the matrix is covered


def test_catalogue_covers_every_optimizer_and_hyperparameter():
    """The catalogue is generated from the matrix: each entry's float hyperparameters, refused both ways."""
    ids = {p.id for p in PARAMS}
    for e in ENTRIES.values():
        for name, low, *_ in e.intervals:
            bad = "-0.5" if low is not None else "nan"  # (SGD's dampening has no range: torch checks none)
            assert f"{e.cls.__name__}:{e.cls.__name__}-init-{name}={bad}" in ids, (e.name, name)
            assert f"{e.cls.__name__}:{e.cls.__name__}-group1-{name}={bad}-then-step" in ids, (e.name, name)
        assert f"{e.cls.__name__}:load-step-nan" in ids, e.name


def test_snapshot_notices_one_ulp_and_a_step_counter():
    """The checker itself: a one-ULP change of a state, or one more step, is a difference."""
    w = two_group_world(Adam)
    before = snapshot(w.params, w.opt)
    state = w.opt.flat_buffers()[0].states["exp_avg"]
    state[0] = torch.nextafter(state[0], torch.tensor(math.inf))
    with pytest.raises(AssertionError):
        assert_same(before, snapshot(w.params, w.opt))
    w = two_group_world(Adam)
    before = snapshot(w.params, w.opt)
    p = w.opt.param_groups[1]["params"][0]
    w.opt.state[p]["step"] = w.opt.state[p]["step"] + 1
    with pytest.raises(AssertionError):
        assert_same(before, snapshot(w.params, w.opt))


@pytest.mark.parametrize("cls,case", PARAMS)
def test_bad_input_is_refused_and_changes_nothing(cls, case):
    world = case.build(cls)
    case.prepare(world)
    before = snapshot(world.params, world.opt)
    with pytest.raises(case.exc, match=case.match):
        case.act(world)
    assert_same(before, snapshot(world.params, world.opt))


@pytest.mark.parametrize("cls", [c.cls for c in OPTIMIZERS.values()], ids=lambda c: c.__name__)
def test_a_good_step_after_refused_inputs_still_works(cls):
    """A refused call leaves an optimizer that steps exactly like an untouched twin."""
    a, b = two_group_world(cls), two_group_world(cls)
    force_grad(a.params[2], torch.ones(5, 1))
    with pytest.raises(ValueError):
        a.opt.step()
    sd = _clone(a.opt.state_dict())
    sd["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError):
        a.opt.load_state_dict(sd)
    a.params[2].grad = b.params[2].grad.clone()
    a.opt.step()
    b.opt.step()
    sa, sb = snapshot(a.params, a.opt), snapshot(b.params, b.opt)
    del sa["group_params"], sb["group_params"]  # object ids differ between the twins
    assert_same(sa, sb)


def test_single_element_tensor_lr_is_accepted_like_torch():
    """torch.optim accepts a 1-element tensor lr (and refuses 2 elements: covered above)."""
    p = make_params(shapes=((3,),))
    opt = Adam(p, lr=torch.tensor(0.01))
    before = p[0].detach().clone()
    opt.step()
    assert not torch.equal(before, p[0])


def test_meta_device_parameters_are_accepted_alone():
    """The mixed-device cases use "meta" as a second device: on its own it is a valid device."""
    opt = Adam([_meta_param((4,))], lr=0.1)
    assert opt.flat_buffers()[0].device.type == "meta"


@pytest.mark.parametrize("cls", [c.cls for c in OPTIMIZERS.values()], ids=lambda c: c.__name__)
def test_a_group_over_two_devices_gets_one_buffer_per_device(cls):
    """torch.optim accepts a group whose parameters live on several devices; so do we, one buffer each."""
    ps = make_params()
    opt = cls([ps[0], _meta_param(), ps[1]], lr=0.1)
    assert sorted(i.device.type for i in opt.flat_buffers()) == ["cpu", "meta"]
    assert [i.param_indices for i in opt.flat_buffers() if i.device.type == "cpu"] == [(0, 2)]


def test_top_level_set_of_params_is_refused():
    ps = make_params()
    with pytest.raises(TypeError, match=r"params.*ordered.*set"):
        Adam(set(ps), lr=0.1)


def test_master_weights_set_later_must_be_a_bool():
    w = two_group_world(Adam)
    w.opt.param_groups[1]["master_weights"] = "yes"
    with pytest.raises(TypeError, match=r"master_weights.*'yes'"):
        w.opt.step()


def test_precision_option_changed_after_states_exist_is_refused():
    w = two_group_world(Adam)
    w.opt.param_groups[1]["state_dtype"] = torch.float64
    with pytest.raises(ValueError, match=r"state_dtype"):
        w.opt.step()


def test_huge_int_hyperparameter_is_refused_or_works():
    p = make_params(shapes=((3,),))
    opt = Adam(p, lr=0.1, epsilon=2**70)
    opt.step()
    assert torch.isfinite(p[0]).all()


def test_hyperparameter_beyond_float32_range_is_refused_before_any_write():
    w = two_group_world(Adam)
    w.opt.param_groups[1]["lr"] = 1e39
    before = snapshot(w.params, w.opt)
    with pytest.raises(ValueError, match=r"lr"):
        w.opt.step()
    assert_same(before, snapshot(w.params, w.opt))


@pytest.mark.parametrize("value, exc", [("3", ValueError), (torch.ones(2), ValueError), (float("nan"), ValueError)])
def test_bad_step_assignment_is_a_clear_error(value, exc):
    p = torch.nn.Parameter(torch.ones(2))
    opt = Adam([p])
    with pytest.raises(exc, match="step"):
        opt.state[p]["step"] = value
