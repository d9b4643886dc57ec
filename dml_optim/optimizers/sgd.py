"""torch.optim.SGD, exactly, flat and in place: the ONNX Momentum rule with torch's signature."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import dml_optim.core.functional as F
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["SGD"]



def _states(hyper) -> tuple[str, ...]:
    return ("momentum_buffer",) if hyper["momentum"] != 0 else ()


def _constants(hyper):
    return {"alpha": hyper["momentum"], "norm_coefficient": hyper["weight_decay"], "nesterov": hyper["nesterov"],
            "grad_sign": -1.0 if hyper["maximize"] else 1.0}


def _coefficients(hyper, T):
    # torch ignores dampening without momentum.  In a compiled kernel a zero momentum is structure (a number,
    # ``zero_skips``) and a nonzero one a 0-d tensor: testing the tensor would break the graph in two
    momentum = hyper["momentum"]
    beta = 1.0 - hyper["dampening"] if isinstance(momentum, torch.Tensor) or momentum != 0 else 1.0
    return F.momentum_coefficients(hyper["lr"], T, beta=beta)


def _apply(x, g, v=None, *, scratch, **scalars):
    F.momentum_(x, g, v, scratch=scratch[0], **scalars)


def _fused(hyper, count):
    # the first buffer step is the gradient (T == 0, as the rule decides it): dampening 0 into a zero buffer
    return "_fused_sgd_", dict(weight_decay=hyper["weight_decay"], momentum=hyper["momentum"], lr=hyper["lr"],
                               dampening=hyper["dampening"] if count > 0 else 0.0, nesterov=hyper["nesterov"],
                               maximize=hyper["maximize"], is_first_step=False)


#: torch.optim.SGD's update, as data (:class:`~dml_optim.core.rule.Rule`): the momentum buffer only with momentum.
RULE = Rule(
    name="SGD", apply=_apply, coefficients=_coefficients, constants=_constants, states=("momentum_buffer",),
    states_for=_states, skip_identity={"lr": 0.0, "alpha": 1.0, "grad_scale": 0.0, "norm_coefficient": 0.0},
    zero_skips=("momentum", "weight_decay"), fused=_fused, fused_counts="first")


class SGD(FlatOptimizer):
    r"""``torch.optim.SGD``: the same signature, defaults and update, in two to five native ops.

    With ``g = -G if maximize else G``, ``G_reg = g + weight_decay * X`` and
    ``T`` = completed steps::

        momentum == 0:  X = X - lr * G_reg                         (no state)
        otherwise:      B = G_reg if T == 0 else momentum * B + (1 - dampening) * G_reg
                        X = X - lr * (G_reg + momentum * B if nesterov else B)

    This is ONNX ``Momentum-1`` (:class:`~dml_optim.Momentum`: ``alpha`` =
    ``momentum``, ``beta`` = ``1 - dampening``, ``norm_coefficient`` =
    ``weight_decay``), the same kernel (:func:`dml_optim.core.functional.momentum_`),
    with torch's names, defaults (``lr=1e-3``, ``momentum=0``), ``maximize``, and
    torch's rule that ``momentum=0`` keeps no buffer and ignores ``dampening``.
    ``nesterov=True`` needs ``momentum > 0`` and ``dampening = 0``, as in torch.
    ``foreach``/``fused`` are accepted and change nothing (every step is flat);
    ``differentiable=True`` is refused.  The state is torch's ``momentum_buffer``,
    so checkpoints move both ways between the two.

    With ``backend="eager"``, bit for bit equal to torch's single-tensor SGD
    except with ``nesterov=True``, where the kernel subtracts ``lr * G_reg`` and
    ``lr * momentum * B`` as two updates (torch adds them first): about 1 ulp of
    the parameters per step (float32: 6e-8 after 5 steps; float64: 2e-16).  On
    the CPU the default backend runs torch's fused SGD kernel on the flat buffer
    (``torch.optim.SGD(fused=True)``'s arithmetic: see dml_optim/backends/fused.py).  Where torch decides the
    first buffer step by "no buffer yet", this rule decides it by ``T == 0``:
    turning ``momentum`` on mid-run with ``dampening != 0`` damps the first
    buffer step where torch would not.
    """

    spec = OptimizerSpec(
        name="sgd",
        title="SGD (torch.optim.SGD)",
        reference="torch.optim.SGD (= ONNX ai.onnx.preview.training Momentum-1 with torch's names)",
        hyperparameters=(
            Hyperparameter("lr", 1e-3, "learning rate", low=0.0),
            Hyperparameter("momentum", 0.0, "momentum factor (0: no buffer)", low=0.0),
            Hyperparameter("dampening", 0.0, "the gradient enters the buffer as (1 - dampening) * G"),
            Hyperparameter("weight_decay", 0.0, "L2 coefficient added to the gradient", low=0.0),
            Hyperparameter("nesterov", False, "Nesterov momentum", kind="bool"),
            Hyperparameter("maximize", False, "maximize the objective", kind="bool"),
        ),
        torch=TorchEquivalent("SGD", same=("momentum", "dampening", "weight_decay", "nesterov", "maximize"), flags=()),
        default_lr=1e-3,
        train_lr=5e-2,
        constraints=((lambda h: not h["nesterov"] or (h["momentum"] > 0 and h["dampening"] == 0),
                      "Nesterov momentum requires a momentum and zero dampening (nesterov, momentum, dampening)"),),
    )
    rule = RULE

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize),
                         {}, options, dict(foreach=foreach, fused=fused, differentiable=differentiable))
