"""ONNX-spec Adagrad (``ai.onnx.preview.training::Adagrad``), flat and in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dml_optim.core.functional as F
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent, same_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["Adagrad"]



def _initial(hyper, name: str) -> float:
    return hyper["initial_accumulator_value"]


def _scratch(hyper, gated: bool) -> int:
    return 2 if hyper["norm_coefficient"] else 1


def _constants(hyper):
    return {"epsilon": hyper["epsilon"], "norm_coefficient": hyper["norm_coefficient"],
            "grad_sign": -1.0 if hyper["maximize"] else 1.0}


def _coefficients(hyper, T):
    return F.adagrad_coefficients(hyper["lr"], T, decay_factor=hyper["decay_factor"])


def _apply(x, g, h, *, scratch, **scalars):
    F.adagrad_(x, g, h, scratch=scratch[0], scratch2=scratch[1], **scalars)


def _fused(hyper, count):
    # torch.optim.Adagrad: lr / (1 + (step - 1) * lr_decay) with step = T + 1
    return "_fused_adagrad_", dict(lr=hyper["lr"], lr_decay=hyper["decay_factor"],
                                   weight_decay=hyper["norm_coefficient"], eps=hyper["epsilon"],
                                   maximize=hyper["maximize"])


#: ONNX Adagrad-1's update, as data (:class:`~dml_optim.core.rule.Rule`): T = completed steps.
RULE = Rule(
    name="Adagrad", apply=_apply, coefficients=_coefficients, constants=_constants, states=("sum",),
    unsigned_states=("sum",), skip_identity={"epsilon": 1.0, "rate": 0.0, "norm_coefficient": 0.0},
    zero_skips=("decay_factor", "norm_coefficient"), scratch_slots=2, scratch_for=_scratch, fused=_fused,
    fused_counts="none", initial=_initial)


class Adagrad(FlatOptimizer):
    r"""Adagrad as the ONNX ``Adagrad-1`` operator defines it.

    Per step, with ``T`` = completed steps (0 on the first step, as the ONNX
    text asks) and ``G_reg = norm_coefficient * X + G``::

        r = lr / (1 + T * decay_factor)
        H = H + G_reg * G_reg
        X = X - r * G_reg / (sqrt(H) + epsilon)

    Spec: ONNX ``ai.onnx.preview.training`` ``Adagrad`` version 1.

    torch.optim names (accepted, and kept in param groups): ``lr_decay`` =
    ``decay_factor``, ``eps`` = ``epsilon``, ``weight_decay`` =
    ``norm_coefficient``; ``initial_accumulator_value`` (the value ``H``
    starts at) and ``maximize`` (``G_reg = norm_coefficient * X - G``) are
    torch's.  The constructor takes torch.optim.Adagrad's positional order
    (``lr, lr_decay, weight_decay, initial_accumulator_value, eps, foreach``),
    so this is a drop-in ``torch.optim.Adagrad`` (state ``sum`` = ONNX ``H``);
    ``foreach``/``fused`` are accepted and change nothing.

    .. note:: The default ``epsilon`` is ``1e-10`` (torch's).  The ONNX
       operator page says 0 and the ONNX schema (``onnx/defs/training/defs.cc``)
       says ``1e-6``; with epsilon 0 a parameter whose gradient has always been
       zero gets ``0 / 0`` = NaN.  Pass ``epsilon=0.0`` for the page's literal default.
    """

    spec = OptimizerSpec(
        name="adagrad",
        title="ONNX Adagrad",
        reference="ONNX ai.onnx.preview.training Adagrad-1",
        hyperparameters=(
            Hyperparameter("lr", 1e-2, "learning rate R", low=0.0),
            Hyperparameter("decay_factor", 0.0, "learning-rate decay: r = R / (1 + T * decay_factor)", low=0.0),
            Hyperparameter("epsilon", 1e-10, "added to sqrt(H)", low=0.0),
            Hyperparameter("norm_coefficient", 0.0, "L2 coefficient added to the gradient", low=0.0),
            Hyperparameter("initial_accumulator_value", 0.0, "the value H starts at (torch's name)", low=0.0),
            Hyperparameter("maximize", False, "maximize the objective (torch's name)", kind="bool"),
        ),
        torch=TorchEquivalent(
            "Adagrad",
            aliases=(same_alias("lr_decay", "decay_factor"), same_alias("eps", "epsilon"),
                     same_alias("weight_decay", "norm_coefficient")),
            same=("initial_accumulator_value", "maximize"),
            flags=(),  # maximize is ours
        ),
        default_lr=1e-2,
        train_lr=3e-2,
    )
    rule = RULE

    def __init__(self, params, lr: float = 1e-2, lr_decay: float | None = None, weight_decay: float | None = None,
                 initial_accumulator_value: float = 0.0, eps: float | None = None, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None,
                 decay_factor: float = 0.0, epsilon: float = 1e-10, norm_coefficient: float = 0.0,
                 **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, decay_factor=decay_factor, epsilon=epsilon, norm_coefficient=norm_coefficient,
                                      initial_accumulator_value=initial_accumulator_value, maximize=maximize),
                         dict(lr_decay=lr_decay, eps=eps, weight_decay=weight_decay), options,
                         dict(foreach=foreach, fused=fused, differentiable=differentiable))
