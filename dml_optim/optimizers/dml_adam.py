"""DirectML's ``DML_OPERATOR_ADAM_OPTIMIZER`` rule, flat and in place."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

import dml_optim.core.functional as F
from dml_optim.core.dtypes import state_dtype
from dml_optim.optimizers.adam import _EPS_DIFFERS
from dml_optim.core.rule import Rule
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.spec import Hyperparameter, OptimizerSpec, TorchEquivalent, betas_alias

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.core.options import OptimizerOptions

__all__ = ["DmlAdam", "UINT32_MAX"]

UINT32_MAX = 2**32 - 1



def _constants(hyper):
    return {"alpha": hyper["beta1"], "beta": hyper["beta2"], "epsilon": hyper["epsilon"]}


def _coefficients(hyper, T):
    return F.dml_adam_coefficients(hyper["lr"], T, beta1=hyper["beta1"], beta2=hyper["beta2"])


def _apply(x, g, m, v, *, scratch, **scalars):
    F.adam_(x, g, m, v, scratch=scratch[0], **scalars)


def _fused(hyper, count):
    return "_fused_adam_", dict(lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=0.0,
                                eps=F.epsilon_before_correction(hyper["epsilon"], hyper["beta2"], count + 1),
                                amsgrad=False, maximize=False)


#: DirectML's ADAM_OPTIMIZER update, as data (:class:`~dml_optim.core.rule.Rule`): T = completed steps + 1, DirectML's
#: UINT32 TrainingStepTensor; FLOAT32 and FLOAT16 tensors only.
RULE = Rule(
    name="DmlAdam", apply=_apply, coefficients=_coefficients, constants=_constants, states=("exp_avg", "exp_avg_sq"),
    unsigned_states=("exp_avg_sq", "max_exp_avg_sq"), step_offset=1, max_step=UINT32_MAX,
    max_step_reason="T is DirectML's UINT32 TrainingStepTensor", dtypes=(torch.float32, torch.float16),
    skip_identity={"epsilon": 1.0, "step_size": 0.0, "alpha": 1.0, "beta": 1.0}, scratch_slots=2, fused=_fused)


class DmlAdam(FlatOptimizer):
    r"""Adam exactly as DirectML's ``ADAM_OPTIMIZER`` operator computes it.

    Per step, with ``T`` = completed steps + 1 (DirectML's ``TrainingStepTensor``,
    a UINT32 scalar)::

        M = beta1 * M + (1 - beta1) * G
        V = beta2 * V + (1 - beta2) * G * G
        X = X - lr * sqrt(1 - beta2**T) / (1 - beta1**T) * M / (sqrt(V) + epsilon)

    Spec: ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` (DirectML 1.4, feature level 3_0).
    DirectML's docs leave ``T = 0`` undefined (``0/0``); like Microsoft's
    TensorFlow-DirectML plugin we start at 1.

    Constraints DirectML puts on the operator are enforced here: parameters
    must be float32 or float16 (the operator has no bfloat16 or float64), and
    ``T`` must fit in UINT32 (a clear error before it would wrap).
    :meth:`dml_descriptors` returns the ADAM_OPTIMIZER descriptor of each flat
    buffer, in place, validated by :func:`dml_optim.dml.validate`.

    torch.optim names: ``betas`` = ``(beta1, beta2)``.  ``torch.optim.Adam(lr,
    betas, eps=0)`` computes the same update.  State names follow torch.optim
    (``exp_avg`` = DirectML ``M``, ``exp_avg_sq`` = DirectML ``V``).

    .. warning:: Epsilon is added to the *uncorrected* ``sqrt(V)``; torch.optim
       adds it to the bias-corrected one, so ``eps=`` is refused.  In float16 the
       default ``1e-8`` rounds to 0 (smallest subnormal 2**-24): use
       ``epsilon >= 6e-8`` (``1e-4`` is a common choice) with float16 state.
    """

    spec = OptimizerSpec(
        name="dml-adam",
        title="DirectML ADAM_OPTIMIZER",
        reference="DML_ADAM_OPTIMIZER_OPERATOR_DESC (DirectML 1.4, feature level 3_0)",
        hyperparameters=(
            Hyperparameter("lr", 1e-3, "LearningRate", low=0.0),
            Hyperparameter("beta1", 0.9, "Beta1: first-moment decay", low=0.0, high=1.0, high_open=True),
            Hyperparameter("beta2", 0.999, "Beta2: second-moment decay", low=0.0, high=1.0, high_open=True),
            Hyperparameter("epsilon", 1e-8, "Epsilon: added to sqrt(V) before the bias correction", low=0.0),
        ),
        torch=TorchEquivalent(
            "Adam",
            aliases=(betas_alias("beta1", "beta2"),),
            nearest={"epsilon": "eps"},
            exact_when=(("epsilon", lambda h: h["epsilon"] == 0, "epsilon is placed differently; equal only at 0"),),
            refused={"eps": _EPS_DIFFERS},
        ),
        default_lr=1e-3,
        train_lr=3e-3,
    )
    rule = RULE

    def __init__(self, params, lr: float = 1e-3, *, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                 betas: tuple[float, float] | None = None, **options: "Unpack[OptimizerOptions]"):
        super().__init__(params, dict(lr=lr, beta1=beta1, beta2=beta2, epsilon=epsilon), dict(betas=betas), options)

    @classmethod
    def _dtype_hint(cls) -> str:
        return " (DirectML's ADAM_OPTIMIZER takes FLOAT32 or FLOAT16 tensors; use dml_optim.Adam for other dtypes)"

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        super()._check_group(group, gi)
        for key in ("state_dtype", "compute_dtype"):
            if group[key] not in (None, torch.float32, torch.float16):
                raise TypeError(f"{key}={group[key]} is not supported by DmlAdam: DirectML's ADAM_OPTIMIZER takes "
                                "FLOAT32 or FLOAT16 only")

    def dml_descriptors(self) -> list[dict[str, Any]]:
        """The ADAM_OPTIMIZER descriptor of every flat buffer, in the JSON form of
        ``dml-optim validate`` (in-place bindings included), each validated.

        A buffer larger than 2**32 - 1 elements is described as several
        operators (``split_for_dml``).  Raises ``ValueError`` if a descriptor
        violates a DirectML rule.
        """
        from dml_optim.dml import adam_descriptor, dumps, split_for_dml, validate

        self._follow()
        out = []
        for gi, group in enumerate(self.param_groups):
            for fi, flat in enumerate(self._buffers_of(gi)):
                if flat.bits:
                    raise ValueError(
                        f"param_groups[{gi}] buffer {fi}: the moments are {flat.bits}-bit block-quantized "
                        "(state_bits); DirectML's ADAM_OPTIMIZER takes FLOAT32 or FLOAT16 moments, so this "
                        "configuration has no single-operator DirectML form")
                sdtype = state_dtype(group, flat.dtype)
                if flat.master is not None or flat.kahan is not None or sdtype != flat.dtype:
                    extra = " with master weights" if flat.master is not None else " with Kahan compensation" if flat.kahan is not None else ""
                    raise ValueError(
                        f"param_groups[{gi}] buffer {fi}: parameters are {flat.dtype} but the moments are "
                        f"{sdtype}{extra}; DirectML's ADAM_OPTIMIZER needs all seven tensors in one data type, "
                        "so this configuration has no single-operator DirectML form"
                    )
                dtype = {torch.float32: "FLOAT32", torch.float16: "FLOAT16"}[flat.dtype]
                prefix = f"param_groups[{gi}].buffer{fi}"
                names = {role: f"{prefix}.{role}" for role in ("parameters", "first_moment", "second_moment", "gradient", "training_step")}
                offset = 0
                for n in split_for_dml(flat.numel):
                    desc = adam_descriptor(
                        n, dtype, learning_rate=float(group["lr"]), beta1=group["beta1"], beta2=group["beta2"],
                        epsilon=group["epsilon"], training_step=flat.counter.max_count() + self.step_offset,
                        buffer_names=names, element_offset=offset,
                    )
                    offset += n
                    report = validate(desc)
                    if not report.valid:
                        raise ValueError(f"DmlAdam built an invalid descriptor for {prefix}: {report.errors[0].message}")
                    out.append(json.loads(dumps(desc)))
        return out
