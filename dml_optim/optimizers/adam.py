"""ONNX-spec Adam (``ai.onnx.preview.training::Adam``), flat and in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dml_optim.core.functional as F
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent, betas_alias, same_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["Adam"]

_EPS_DIFFERS = (
    "torch's eps is added after the bias correction, ONNX Adam's epsilon before it (the two agree only at 0); "
    "pass epsilon= for the ONNX rule, or use dml_optim.AdamW for torch's semantics"
)



def _scratch(hyper, gated: bool) -> int:
    return 2 if hyper["norm_coefficient"] and gated else 1


def _constants(hyper):
    return {k: hyper[k] for k in ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")}


def _coefficients(hyper, T):
    return F.adam_coefficients(hyper["lr"], T, alpha=hyper["alpha"], beta=hyper["beta"])


def _apply(x, g, v, h, *, scratch, **scalars):
    F.adam_(x, g, v, h, scratch=scratch[0], scratch2=scratch[1], **scalars)


def _fused(hyper, count):
    # torch.optim.Adam's kernel adds eps after the bias correction: eps / sqrt(1 - beta**T) puts it before
    if hyper["norm_coefficient_post"] != 0:
        return None
    return "_fused_adam_", dict(lr=hyper["lr"], beta1=hyper["alpha"], beta2=hyper["beta"],
                                weight_decay=hyper["norm_coefficient"],
                                eps=F.epsilon_before_correction(hyper["epsilon"], hyper["beta"], count + 1),
                                amsgrad=False, maximize=False)


#: ONNX Adam-1's update, as data (:class:`~dml_optim.core.rule.Rule`): T = completed steps + 1.
RULE = Rule(
    name="Adam", apply=_apply, coefficients=_coefficients, constants=_constants,
    states=("exp_avg", "exp_avg_sq"), unsigned_states=("exp_avg_sq", "max_exp_avg_sq"), step_offset=1,
    skip_identity={"epsilon": 1.0, "step_size": 0.0, "alpha": 1.0, "beta": 1.0, "norm_coefficient": 0.0,
                   "norm_coefficient_post": 0.0},
    zero_skips=("norm_coefficient", "norm_coefficient_post"), scratch_slots=2, scratch_for=_scratch, fused=_fused)


class Adam(FlatOptimizer):
    r"""Adam as the ONNX ``Adam-1`` operator defines it.

    Per step, with ``T`` = completed steps + 1 and ``G_reg = norm_coefficient * X + G``::

        V = alpha * V + (1 - alpha) * G_reg
        H = beta * H + (1 - beta) * G_reg * G_reg
        X = X - lr * sqrt(1 - beta**T) / (1 - alpha**T) * V / (sqrt(H) + epsilon)
        X = (1 - norm_coefficient_post) * X

    Spec: ONNX ``ai.onnx.preview.training`` ``Adam`` version 1 (``R`` = ``lr``;
    ``T`` starts at 1 because ONNX disables bias correction at ``T = 0``).

    torch.optim names: ``betas`` = ``(alpha, beta)`` and ``weight_decay`` =
    ``norm_coefficient`` are accepted by the constructor and kept in every
    param group beside ours.  ``torch.optim.Adam(lr, betas, eps=0,
    weight_decay)`` computes the same update.

    .. warning:: Epsilon is added to the *uncorrected* ``sqrt(H)``; torch.optim
       adds it to ``sqrt(H / (1 - beta**T))``.  With ``epsilon > 0`` the two
       differ, most in the first steps, so ``eps=`` is refused (use
       :class:`~dml_optim.AdamW` for torch's placement).
       ``norm_coefficient_post`` is a decoupled decay applied after the update
       (``AdamW`` decays before, by ``lr * weight_decay``).

    State names follow torch.optim (``exp_avg`` = ONNX ``V``, ``exp_avg_sq`` =
    ONNX ``H``), so a ``torch.optim.Adam`` state dict loads into this class.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate ``R`` (>= 0).
        alpha: first-moment decay, in [0, 1).
        beta: second-moment decay, in [0, 1).
        epsilon: added to ``sqrt(H)`` (>= 0).
        norm_coefficient: L2 coefficient added to the gradient (>= 0).
        norm_coefficient_post: decay of the updated parameters, in [0, 1].
        betas: torch's name for ``(alpha, beta)``.
        weight_decay: torch's name for ``norm_coefficient``.
        **options: ``backend``, ``state_dtype``, ``compute_dtype``,
            ``master_weights``, ``kahan``, ``nonfinite``, ``capturable``,
            ``atomic``, ``checks``, ``pack_via`` (see README, "Options").
    """

    spec = OptimizerSpec(
        name="adam",
        title="ONNX Adam",
        reference="ONNX ai.onnx.preview.training Adam-1",
        hyperparameters=(
            Hyperparameter("lr", 1e-3, "learning rate R", low=0.0),
            Hyperparameter("alpha", 0.9, "first-moment decay", low=0.0, high=1.0, high_open=True),
            Hyperparameter("beta", 0.999, "second-moment decay", low=0.0, high=1.0, high_open=True),
            Hyperparameter("epsilon", 1e-6, "added to sqrt(H) before the bias correction", low=0.0),
            Hyperparameter("norm_coefficient", 0.0, "L2 coefficient added to the gradient", low=0.0),
            Hyperparameter("norm_coefficient_post", 0.0, "decay of the updated parameters", low=0.0, high=1.0),
        ),
        torch=TorchEquivalent(
            "Adam",
            aliases=(betas_alias("alpha", "beta"), same_alias("weight_decay", "norm_coefficient")),
            requires=(("norm_coefficient_post", lambda h: h["norm_coefficient_post"] == 0,
                       "torch.optim.Adam has no post-update decay"),),
            exact_when=(("epsilon", lambda h: h["epsilon"] == 0, "epsilon is placed differently; equal only at 0"),),
            nearest={"epsilon": "eps"},
            refused={"eps": _EPS_DIFFERS},
            fixed={"decoupled_weight_decay": False},  # norm_coefficient is torch.optim.Adam's L2 weight_decay
        ),
        default_lr=1e-3,
        train_lr=3e-3,
    )
    rule = RULE

    def __init__(self, params, lr: float = 1e-3, *, alpha: float = 0.9, beta: float = 0.999, epsilon: float = 1e-6,
                 norm_coefficient: float = 0.0, norm_coefficient_post: float = 0.0,
                 betas: tuple[float, float] | None = None, weight_decay: float | None = None,
                 **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, alpha=alpha, beta=beta, epsilon=epsilon, norm_coefficient=norm_coefficient,
                                      norm_coefficient_post=norm_coefficient_post),
                         dict(betas=betas, weight_decay=weight_decay), options)
