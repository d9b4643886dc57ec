"""The four optimizers against independent oracles over 50 steps (DESIGN.md §2).

Model: mixed shapes (0-d, 1-d, 2-d, 4-d conv weight) in two param groups with
different hyperparameters (the second with ``norm_coefficient``/``weight_decay``).
Each optimizer is compared, at every step, with

* ``torch.optim`` per the equivalences of DESIGN.md §2 (Adam and DmlAdam with
  epsilon 0; Adagrad; Momentum standard with beta != 1, nesterov with beta = 1);
* ``dml_optim.functional``'s out-of-place ONNX-convention functions applied
  parameter by parameter, with T as DESIGN.md §2 says (Adam/DmlAdam from 1,
  Adagrad/Momentum from 0).

The matrix (case x dtype) is data; ids read ``adam-float64`` etc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import dml_optim
from dml_optim import functional as F
from tolerances import TORCH_ADAM_FLOAT32, assert_close

STEPS = 50
SHAPES = [(), (7,), (5, 3), (4, 3, 3, 3)]
#: Which parameter goes to which group: 0-d and conv in group 0, 1-d and 2-d in group 1.
GROUPS = [[0, 3], [1, 2]]


@dataclass(frozen=True)
class Case:
    id: str
    ours: Callable[..., torch.optim.Optimizer]
    groups: tuple[dict[str, Any], dict[str, Any]]  # our hyperparameters per group
    torch_opt: Callable[..., torch.optim.Optimizer] | None
    torch_groups: tuple[dict[str, Any], dict[str, Any]] | None
    functional: Callable  # (hyper, T_completed, x, g, states) -> (x_new, states_new)
    state_names: tuple[str, ...]
    #: DmlAdam takes float32/float16 only (DirectML's ADAM_OPTIMIZER has no float64).
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)


def _adam_ref(h, t, x, g, states):
    out = F.adam(h["lr"], t + 1, x, g, *states, alpha=h["alpha"], beta=h["beta"], epsilon=h["epsilon"],
                 norm_coefficient=h["norm_coefficient"], norm_coefficient_post=h.get("norm_coefficient_post", 0.0))
    return out[0], list(out[1:])


def _dml_adam_ref(h, t, x, g, states):
    xn, m, v = F.dml_adam(x, states[0], states[1], g, t + 1, learning_rate=h["lr"], beta1=h["beta1"],
                          beta2=h["beta2"], epsilon=h["epsilon"])
    return xn, [m, v]


def _adagrad_ref(h, t, x, g, states):
    out = F.adagrad(h["lr"], t, x, g, *states, decay_factor=h["decay_factor"], epsilon=h["epsilon"],
                    norm_coefficient=h["norm_coefficient"])
    return out[0], list(out[1:])


def _momentum_ref(h, t, x, g, states):
    out = F.momentum(h["lr"], t, x, g, *states, alpha=h["alpha"], beta=h["beta"], mode=h["mode"],
                     norm_coefficient=h["norm_coefficient"])
    return out[0], list(out[1:])


CASES = [
    Case(
        "adam",
        dml_optim.Adam,
        (dict(lr=1e-2, alpha=0.9, beta=0.999, epsilon=0.0, norm_coefficient=0.0),
         dict(lr=3e-3, alpha=0.8, beta=0.99, epsilon=0.0, norm_coefficient=0.01)),
        torch.optim.Adam,
        (dict(lr=1e-2, betas=(0.9, 0.999), eps=0.0, weight_decay=0.0),
         dict(lr=3e-3, betas=(0.8, 0.99), eps=0.0, weight_decay=0.01)),
        _adam_ref,
        ("exp_avg", "exp_avg_sq"),
    ),
    Case(
        "dml-adam",
        dml_optim.DmlAdam,
        (dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=0.0), dict(lr=2e-3, beta1=0.85, beta2=0.98, epsilon=0.0)),
        torch.optim.Adam,
        (dict(lr=1e-2, betas=(0.9, 0.999), eps=0.0), dict(lr=2e-3, betas=(0.85, 0.98), eps=0.0)),
        _dml_adam_ref,
        ("exp_avg", "exp_avg_sq"),
        (torch.float32, torch.float16),
    ),
    Case(
        "adagrad",
        dml_optim.Adagrad,
        (dict(lr=0.1, decay_factor=0.01, epsilon=1e-10, norm_coefficient=0.0),
         dict(lr=0.05, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.02)),
        torch.optim.Adagrad,
        (dict(lr=0.1, lr_decay=0.01, eps=1e-10, weight_decay=0.0), dict(lr=0.05, lr_decay=0.0, eps=1e-6, weight_decay=0.02)),
        _adagrad_ref,
        ("sum",),
    ),
    Case(
        "momentum-standard",
        dml_optim.Momentum,
        (dict(lr=0.05, alpha=0.9, beta=0.8, mode="standard", norm_coefficient=0.0),
         dict(lr=0.02, alpha=0.5, beta=0.9, mode="standard", norm_coefficient=0.01)),
        torch.optim.SGD,
        (dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.0),
         dict(lr=0.02, momentum=0.5, dampening=0.1, weight_decay=0.01)),
        _momentum_ref,
        ("momentum_buffer",),
    ),
    Case(
        "momentum-nesterov",
        dml_optim.Momentum,
        (dict(lr=0.05, alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.0),
         dict(lr=0.02, alpha=0.7, beta=1.0, mode="nesterov", norm_coefficient=0.01)),
        torch.optim.SGD,
        (dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0),
         dict(lr=0.02, momentum=0.7, dampening=0.0, nesterov=True, weight_decay=0.01)),
        _momentum_ref,
        ("momentum_buffer",),
    ),
    # No torch.optim equivalent (epsilon placement, decoupled post-decay): functional oracle only.
    Case(
        "adam-onnx-epsilon-post",
        dml_optim.Adam,
        (dict(lr=1e-2, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.01),
         dict(lr=3e-3, alpha=0.8, beta=0.99, epsilon=1e-3, norm_coefficient=0.05, norm_coefficient_post=0.001)),
        None,
        None,
        _adam_ref,
        ("exp_avg", "exp_avg_sq"),
    ),
    Case(
        "dml-adam-epsilon",
        dml_optim.DmlAdam,
        (dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8), dict(lr=2e-3, beta1=0.85, beta2=0.98, epsilon=1e-4)),
        None,
        None,
        _dml_adam_ref,
        ("exp_avg", "exp_avg_sq"),
        (torch.float32, torch.float16),
    ),
]
_DT = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16"}
MATRIX = [pytest.param(c, d, id=f"{c.id}-{_DT[d]}") for c in CASES for d in c.dtypes]
# float16 against torch.optim would measure torch's float16 arithmetic, not ours: functional oracle only.
TORCH_MATRIX = [p for p in MATRIX if p.values[0].torch_opt is not None and p.values[1] != torch.float16]


def _initial(dtype):
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


def _grads(step: int, dtype):
    g = torch.Generator().manual_seed(10_000 + step)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


def _param_groups(params, hypers):
    return [dict(params=[params[i] for i in idx], **h) for idx, h in zip(GROUPS, hypers)]


#: state_dict() numbers parameters in param-group order: index k is parameter ORDER[k].
ORDER = [i for idx in GROUPS for i in idx]


def _group_of(i: int) -> int:
    return next(gi for gi, idx in enumerate(GROUPS) if i in idx)


def _torch_tol(case: Case, dtype):
    if dtype == torch.float32 and case.torch_opt is torch.optim.Adam:
        return TORCH_ADAM_FLOAT32
    return {}


def test_matrix_covers_every_optimizer():
    classes = {c.ours for c in CASES if c.torch_opt is not None}
    assert classes == {dml_optim.Adam, dml_optim.DmlAdam, dml_optim.Adagrad, dml_optim.Momentum}


@pytest.mark.parametrize("case,dtype", TORCH_MATRIX)
def test_matches_torch_optim_every_step(case: Case, dtype):
    ours_p = [torch.nn.Parameter(t.clone()) for t in _initial(dtype)]
    ref_p = [torch.nn.Parameter(t.clone()) for t in _initial(dtype)]
    ours = case.ours(_param_groups(ours_p, case.groups), lr=case.groups[0]["lr"])  # Momentum requires lr
    ref = case.torch_opt(_param_groups(ref_p, case.torch_groups), foreach=False)
    tol = _torch_tol(case, dtype)
    for step in range(STEPS):
        for p, q, g in zip(ours_p, ref_p, _grads(step, dtype)):
            p.grad = g.clone()
            q.grad = g.clone()
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours_p, ref_p)):
            assert_close(p.detach(), q.detach(), **tol)
    # the states, in torch.optim's names, match too
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    for k in range(len(SHAPES)):
        for name in case.state_names:
            assert_close(ours_sd["state"][k][name], ref_sd["state"][k][name], **tol)
        if "step" in ref_sd["state"][k]:  # torch.optim.SGD keeps no step count
            assert float(ours_sd["state"][k]["step"]) == float(ref_sd["state"][k]["step"]) == STEPS


@pytest.mark.parametrize("case,dtype", MATRIX)
def test_matches_functional_every_step(case: Case, dtype):
    """Flat in-place updates equal the per-parameter out-of-place ONNX-convention functions."""
    ours_p = [torch.nn.Parameter(t.clone()) for t in _initial(dtype)]
    ours = case.ours(_param_groups(ours_p, case.groups), lr=case.groups[0]["lr"])  # Momentum requires lr
    xs = [t.clone() for t in _initial(dtype)]
    states = [[torch.zeros_like(x) for _ in case.state_names] for x in xs]
    for step in range(STEPS):
        grads = _grads(step, dtype)
        for p, g in zip(ours_p, grads):
            p.grad = g.clone()
        ours.step()
        for i, g in enumerate(grads):
            xs[i], states[i] = case.functional(case.groups[_group_of(i)], step, xs[i], g, states[i])
        for p, x in zip(ours_p, xs):
            assert_close(p.detach(), x)
    sd = ours.state_dict()
    for k, i in enumerate(ORDER):
        for name, s in zip(case.state_names, states[i]):
            assert_close(sd["state"][k][name], s)
        assert float(sd["state"][k]["step"]) == STEPS


def test_first_steps_use_the_spec_step_counters():
    """T from 1 for Adam (ONNX T = 0 would skip bias correction: a ~3x larger first
    update with these betas), T from 0 for Momentum (beta applies from the second step)."""
    x0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0.5, 0.25], dtype=torch.float64)
    p = torch.nn.Parameter(x0.clone())
    opt = dml_optim.Adam([p], lr=0.1, epsilon=0.0)
    p.grad = g.clone()
    opt.step()
    # T = 1: V = 0.1 g, H = 0.001 g^2, R_adj = 0.1 * sqrt(0.001) / 0.1: X = x0 - 0.1 * sign(g)
    torch.testing.assert_close(p.detach(), x0 - 0.1 * torch.sign(g), rtol=1e-12, atol=1e-12)
    q = torch.nn.Parameter(x0.clone())
    mom = dml_optim.Momentum([q], lr=0.1, alpha=0.9, beta=0.5)
    q.grad = g.clone()
    mom.step()  # T = 0: V = g (beta not applied)
    torch.testing.assert_close(q.detach(), x0 - 0.1 * g, rtol=1e-12, atol=1e-12)
    q.grad = g.clone()
    mom.step()  # T = 1: V = 0.9 g + 0.5 g
    torch.testing.assert_close(q.detach(), x0 - 0.1 * g - 0.1 * 1.4 * g, rtol=1e-12, atol=1e-12)
