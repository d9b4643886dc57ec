"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one state, the sign of an
interpolation for the update.

Written the way docs/guide/writing-an-optimizer.md shows any element-wise optimizer is written: the update as
data (a :class:`~dml_optim.core.rule.Rule`: its per-step scalars, its in-place element-wise function of native
ops, its state) and a class that names its hyperparameters.  Everything else (flat buffers, every backend,
``state_bits``, the precision modes, the step inside backward, checkpoints, the audit) comes with the base
class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dml_optim.core.functional import axpy_, scale_, signed
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent, betas_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["Lion"]


def _constants(hyper):
    """The step's constant scalars; ``1 - beta`` computed here, from the numbers (a Python float reaching a device
    op through float64 fails on DirectML GPUs without FP64), with the gradient's sign folded in (``maximize``)."""
    sign = -1.0 if hyper["maximize"] else 1.0
    return {"beta1": hyper["beta1"], "beta2": hyper["beta2"], "rest1": signed(1 - hyper["beta1"], sign),
            "rest2": signed(1 - hyper["beta2"], sign)}


def _coefficients(hyper, T):
    """Lion's update does not depend on the step count: the learning rate and the decoupled decay."""
    lr, wd = hyper["lr"], hyper["weight_decay"]
    return {"lr": lr, "decay": 1 - lr * wd if isinstance(wd, torch.Tensor) or wd else 1.0}


def _apply(x, g, m, *, scratch, lr, decay, beta1, beta2, rest1, rest2):
    """``c = beta1 * m + (1 - beta1) * g``; ``x = x * (1 - lr * weight_decay) - lr * sign(c)``;
    ``m = beta2 * m + (1 - beta2) * g``: 7 or 8 ops, in place (``c`` in the scratch), all native on DirectML.

    ``sign(c)`` is ``clamp(c, -tiny, tiny) * (1 / tiny)`` (``tiny``: the compute dtype's smallest normal number,
    a power of two, so the product is exact): ``±1`` for every normal ``c`` and for ``±inf``, 0 for 0, and NaN for
    NaN.  ``torch.sign`` gives 0 for NaN: a NaN gradient would then never reach the parameter, and the NaN it
    leaves in the momentum would stop the parameter for good, silently.  A subnormal ``c`` (a momentum and a
    gradient both below 1e-38 in float32) moves the parameter by its fraction of ``lr``."""
    c = torch.mul(m, beta1, out=scratch[0]) if scratch[0] is not None else m * beta1
    axpy_(c, g, rest1)
    tiny = torch.finfo(c.dtype).tiny
    c.clamp_(-tiny, tiny).mul_(1 / tiny)
    scale_(x, decay)
    axpy_(x, c, lr.neg() if isinstance(lr, torch.Tensor) else -lr)
    scale_(m, beta2)
    axpy_(m, g, rest2)


#: Lion's update, as data: one state (the momentum, ``exp_avg``); a skipped step (a gated one) changes nothing:
#: ``lr`` 0, ``decay`` 1, and the momentum kept (``beta2`` 1, ``rest2`` 0).
RULE = Rule(
    name="Lion", apply=_apply, coefficients=_coefficients, constants=_constants, states=("exp_avg",),
    skip_identity={"lr": 0.0, "decay": 1.0, "beta2": 1.0, "rest2": 0.0}, zero_skips=("weight_decay",),
    scratch_slots=1)


class Lion(FlatOptimizer):
    r"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), flat and in place::

        c = beta1 * m + (1 - beta1) * g
        x = x - lr * (sign(c) + weight_decay * x)
        m = beta2 * m + (1 - beta2) * g

    with ``g = -G if maximize else G``.  One state, ``exp_avg`` (the momentum ``m``): 4 bytes per parameter less
    than AdamW, 1 with ``state_bits=8``.  Defaults are the paper's: ``lr=1e-4`` (3 to 10 times smaller than
    AdamW's for the same task), ``betas=(0.9, 0.99)``, ``weight_decay=0`` (the decay is decoupled, as AdamW's:
    use 3 to 10 times AdamW's).  torch.optim has no Lion: there is no torch twin to load checkpoints from.
    """

    spec = OptimizerSpec(
        name="lion",
        title="Lion",
        reference="Chen et al., Symbolic Discovery of Optimization Algorithms (2023)",
        hyperparameters=(
            Hyperparameter("lr", 1e-4, "learning rate", low=0.0),
            Hyperparameter("beta1", 0.9, "interpolation of the update (betas[0])", low=0.0, high=1.0, high_open=True),
            Hyperparameter("beta2", 0.99, "momentum decay (betas[1])", low=0.0, high=1.0, high_open=True),
            Hyperparameter("weight_decay", 0.0, "decoupled decay: x -= lr * weight_decay * x", low=0.0),
            Hyperparameter("maximize", False, "maximize the objective", kind="bool"),
        ),
        torch=TorchEquivalent(None, aliases=(betas_alias("beta1", "beta2"),), flags=()),
        default_lr=1e-4,
        train_lr=3e-4,
    )
    rule = RULE

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 *, maximize: bool = False, **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=weight_decay, maximize=maximize),
                         dict(betas=betas), options)
