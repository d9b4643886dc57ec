"""torch.optim.AdamW, exactly, flat and in place with DirectML-native ops."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import dml_optim.core.functional as F
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent, betas_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["AdamW"]


def _checkpoint_refusal(saved) -> str | None:
    """A torch.optim.Adam checkpoint (``decoupled_weight_decay=False``) with an L2 weight decay is another rule."""
    if saved.get("decoupled_weight_decay") is False and saved.get("weight_decay", 0):
        return ("it is a torch.optim.Adam checkpoint with weight_decay (an L2 term on the gradient), "
                "not AdamW's decoupled decay")
    return None



def _states(hyper) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if hyper["amsgrad"] else ())


def _constants(hyper):
    return {"alpha": hyper["beta1"], "beta": hyper["beta2"], "grad_sign": -1.0 if hyper["maximize"] else 1.0}


def _coefficients(hyper, T):
    return F.adamw_coefficients(hyper["lr"], T, beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                                weight_decay=hyper["weight_decay"])


def _apply(x, g, m, v, v_max=None, *, scratch, **scalars):
    F.adam_(x, g, m, v, h_max=v_max, scratch=scratch[0], **scalars)


def _fused(hyper, count):
    return "_fused_adamw_", {k: hyper[k] for k in ("lr", "beta1", "beta2", "weight_decay", "eps", "amsgrad", "maximize")}


#: torch.optim.AdamW's update, as data (:class:`~dml_optim.core.rule.Rule`): t = completed steps + 1.
RULE = Rule(
    name="AdamW", apply=_apply, coefficients=_coefficients, constants=_constants, states=("exp_avg", "exp_avg_sq"),
    states_for=_states, unsigned_states=("exp_avg_sq", "max_exp_avg_sq"), step_offset=1,
    skip_identity={"epsilon": 1.0, "step_size": 0.0, "alpha": 1.0, "beta": 1.0, "decay": 1.0},
    zero_skips=("weight_decay",), scratch_slots=2, fused=_fused, fused_counts="none")


class AdamW(FlatOptimizer):
    r"""``torch.optim.AdamW``: the same signature, defaults and update, in a handful of native ops.

    With ``g = -G if maximize else G`` and ``t`` = completed steps + 1::

        X = X * (1 - lr * weight_decay)
        M = beta1 * M + (1 - beta1) * g
        V = beta2 * V + (1 - beta2) * g * g
        V_hat = max(V_max, V) if amsgrad (V_max kept as state) else V
        X = X - (lr / (1 - beta1**t)) * M / (sqrt(V_hat) / sqrt(1 - beta2**t) + eps)

    Epsilon is added *after* the bias correction, as in torch (unlike
    :class:`~dml_optim.Adam` and :class:`~dml_optim.DmlAdam`, whose specs add it
    before).  ``weight_decay=0`` is ``torch.optim.Adam`` exactly.  Changing
    the import is the whole migration: ``betas``, ``eps``, ``weight_decay``,
    ``amsgrad``, ``maximize`` and ``capturable`` mean what they mean in torch;
    ``foreach`` and ``fused`` are accepted, kept in the param groups as torch
    keeps them, and change nothing (every step is flat: one buffer per group,
    device and dtype); ``differentiable=True`` is refused.  States are torch's (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``), so checkpoints move both ways between the two.

    The step (see :func:`dml_optim.core.functional.adamw_coefficients`) runs as at
    most 10 element-wise ops per flat buffer, all native on DirectML: no
    ``lerp``, no ``_foreach_*``, no host sync, no allocation.  On the CPU the
    default backend calls torch's own ``_fused_adamw_`` kernel on the flat
    buffer instead (one call a step: dml_optim/backends/fused.py).
    """

    spec = OptimizerSpec(
        name="adamw",
        title="AdamW (torch.optim.AdamW)",
        reference="torch.optim.AdamW; Loshchilov & Hutter, Decoupled Weight Decay Regularization (2019)",
        hyperparameters=(
            Hyperparameter("lr", 1e-3, "learning rate", low=0.0),
            Hyperparameter("beta1", 0.9, "first-moment decay (betas[0])", low=0.0, high=1.0, high_open=True),
            Hyperparameter("beta2", 0.999, "second-moment decay (betas[1])", low=0.0, high=1.0, high_open=True),
            Hyperparameter("eps", 1e-8, "added after the bias correction", low=0.0),
            Hyperparameter("weight_decay", 1e-2, "decoupled decay: X *= 1 - lr * weight_decay", low=0.0),
            Hyperparameter("amsgrad", False, "use the running maximum of V", kind="bool"),
            Hyperparameter("maximize", False, "maximize the objective", kind="bool"),
        ),
        torch=TorchEquivalent(
            "AdamW",
            aliases=(betas_alias("beta1", "beta2"),),
            same=("eps", "weight_decay", "amsgrad", "maximize"),
            flags=(),  # amsgrad and maximize are ours; decoupled_weight_decay: see checkpoint_refusal
            fixed={"decoupled_weight_decay": True},
        ),
        default_lr=1e-3,
        train_lr=3e-3,
    )
    rule = RULE
    #: a torch.optim checkpoint this class must not load (see the state-dict loader)
    checkpoint_refusal = staticmethod(_checkpoint_refusal)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, **options: "Unpack[OptimizerOptions]"):
        if foreach and not capturable:  # torch.optim.Adam(W)'s own refusals, for drop-in parity (its foreach kernels)
            if isinstance(lr, torch.Tensor):
                raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True "
                                 "(torch.optim.AdamW refuses it; pass a float lr or foreach=None)")
            if isinstance(betas, (tuple, list)) and betas and isinstance(betas[0], torch.Tensor):
                raise ValueError("betas[0] as a Tensor is not supported for capturable=False and foreach=True "
                                 "(torch.optim.AdamW refuses it; pass float betas or foreach=None)")
        super().__init__(params, dict(lr=lr, beta1=0.9, beta2=0.999, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize),
                         dict(betas=betas), dict(options, capturable=capturable),
                         dict(foreach=foreach, fused=fused, differentiable=differentiable))
