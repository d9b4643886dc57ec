"""ONNX-spec Momentum (``ai.onnx.preview.training::Momentum``), flat and in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dml_optim.core.functional as F
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import REQUIRED, Hyperparameter, OptimizerSpec, TorchAlias, TorchEquivalent, _one_float, same_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["Momentum"]


def _nesterov(value) -> tuple[str]:
    if not isinstance(value, bool):
        raise TypeError(f"must be a bool, got {value!r}")
    return ("nesterov" if value else "standard",)


def _dampening(value) -> tuple[float]:
    (dampening,) = _one_float(value)
    return (1.0 - dampening,)



def _constants(hyper):
    return {"alpha": hyper["alpha"], "norm_coefficient": hyper["norm_coefficient"], "nesterov": hyper["mode"] == "nesterov"}


def _coefficients(hyper, T):
    return F.momentum_coefficients(hyper["lr"], T, beta=hyper["beta"])


def _apply(x, g, v, *, scratch, **scalars):
    F.momentum_(x, g, v, scratch=scratch[0], **scalars)


def _fused(hyper, count):
    # torch.optim.SGD's kernel: buffer = momentum * buffer + (1 - dampening) * G_reg; ONNX's first step
    # (beta_adj = 1) is dampening 0.  alpha = 0 keeps ONNX's buffer (beta * G_reg): torch keeps none
    if hyper["alpha"] == 0:
        return None
    return "_fused_sgd_", dict(weight_decay=hyper["norm_coefficient"], momentum=hyper["alpha"], lr=hyper["lr"],
                               dampening=1.0 - hyper["beta"] if count > 0 else 0.0,
                               nesterov=hyper["mode"] == "nesterov", maximize=False, is_first_step=False)


#: ONNX Momentum-1's update, as data (:class:`~dml_optim.core.rule.Rule`): T = completed steps.
RULE = Rule(
    name="Momentum", apply=_apply, coefficients=_coefficients, constants=_constants, states=("momentum_buffer",),
    skip_identity={"lr": 0.0, "alpha": 1.0, "grad_scale": 0.0, "norm_coefficient": 0.0},
    zero_skips=("norm_coefficient",), fused=_fused, fused_counts="first")


class Momentum(FlatOptimizer):
    r"""SGD with momentum as the ONNX ``Momentum-1`` operator defines it.

    Per step, with ``T`` = completed steps (0 on the first step) and
    ``G_reg = norm_coefficient * X + G``::

        V = alpha * V + (beta if T > 0 else 1) * G_reg
        standard: X = X - lr * V
        nesterov: X = X - lr * (G_reg + alpha * V)

    Spec: ONNX ``ai.onnx.preview.training`` ``Momentum`` version 1 (``lr`` is
    required, as ONNX's ``R`` is).

    torch.optim names (accepted, and kept in param groups): ``momentum`` =
    ``alpha``, ``dampening`` = ``1 - beta``, ``nesterov`` = ``mode ==
    "nesterov"``, ``weight_decay`` = ``norm_coefficient``.  ``mode="standard"``
    is ``torch.optim.SGD(lr, momentum, dampening, weight_decay)`` exactly;
    ``mode="nesterov"`` with ``beta=1`` is ``SGD(..., nesterov=True,
    dampening=0)``.  The state ``momentum_buffer`` is ONNX ``V``.
    """

    spec = OptimizerSpec(
        name="momentum",
        title="ONNX Momentum",
        reference="ONNX ai.onnx.preview.training Momentum-1",
        hyperparameters=(
            Hyperparameter("lr", REQUIRED, "learning rate R", low=0.0),
            Hyperparameter("alpha", 0.9, "momentum decay", low=0.0, high=1.0),
            Hyperparameter("beta", 1.0, "gradient scale from the second step on", low=0.0, high=1.0),
            Hyperparameter("mode", "standard", "standard or nesterov", kind="choice", choices=F.MOMENTUM_MODES),
            Hyperparameter("norm_coefficient", 0.0, "L2 coefficient added to the gradient", low=0.0),
        ),
        torch=TorchEquivalent(
            "SGD",
            aliases=(same_alias("momentum", "alpha"),
                     TorchAlias("dampening", ("beta",), lambda beta: 1.0 - beta, _dampening),
                     TorchAlias("nesterov", ("mode",), lambda mode: mode == "nesterov", _nesterov),
                     same_alias("weight_decay", "norm_coefficient")),
            requires=(("mode", lambda h: h["mode"] == "standard" or h["beta"] == 1,
                       "torch.optim.SGD's nesterov needs zero dampening, i.e. beta=1"),),
        ),
        default_lr=None,
        train_lr=5e-2,
    )
    rule = RULE

    def __init__(self, params, lr: float, *, alpha: float = 0.9, beta: float = 1.0, mode: str = "standard",
                 norm_coefficient: float = 0.0, momentum: float | None = None, dampening: float | None = None,
                 nesterov: bool | None = None, weight_decay: float | None = None,
                 **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, alpha=alpha, beta=beta, mode=mode, norm_coefficient=norm_coefficient),
                         dict(momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay),
                         options)
