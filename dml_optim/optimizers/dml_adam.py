"""DirectML's ``DML_OPERATOR_ADAM_OPTIMIZER`` rule, flat and in place."""

from __future__ import annotations

import json
from typing import Any

import torch

from dml_optim import functional as F
from dml_optim.optimizers.base import FlatOptimizer

__all__ = ["DmlAdam", "UINT32_MAX"]

UINT32_MAX = 2**32 - 1


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

    Mapping: ``torch.optim.Adam(lr, betas=(beta1, beta2), eps=epsilon)`` is
    identical when ``epsilon == 0``.  State names follow torch.optim
    (``exp_avg`` = DirectML ``M``, ``exp_avg_sq`` = DirectML ``V``).

    .. warning:: Epsilon is added to the *uncorrected* ``sqrt(V)``; torch.optim
       adds it to the bias-corrected one.  In float16 the default ``1e-8`` rounds
       to 0 (smallest subnormal 2**-24): use ``epsilon >= 6e-8`` (``1e-4`` is
       a common choice) with float16 state.
    """

    state_names = ("exp_avg", "exp_avg_sq")
    step_offset = 1
    #: Hyperparameter ranges, checked (and stored as floats) by the base class.
    hyperparameter_ranges = {
        "lr": dict(low=0.0),
        "beta1": dict(low=0.0, high=1.0, high_open=True),
        "beta2": dict(low=0.0, high=1.0, high_open=True),
        "epsilon": dict(low=0.0),
    }
    skip_identity = {"epsilon": 1.0, "step_size": 0.0, "alpha": 1.0, "beta": 1.0}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        backend: str = "auto",
        state_dtype=None,
        compute_dtype=None,
        master_weights: bool = False,
        nonfinite: str = "propagate",
        atomic: bool = False,
    ):
        defaults = dict(lr=lr, beta1=beta1, beta2=beta2, epsilon=epsilon)
        super().__init__(
            params, defaults, backend=backend, state_dtype=state_dtype,
            compute_dtype=compute_dtype, master_weights=master_weights, nonfinite=nonfinite,
            atomic=atomic,
        )

    def _check_param(self, p, index: int, group_index: int) -> None:
        super()._check_param(p, index, group_index)
        if p.dtype not in (torch.float32, torch.float16):
            raise TypeError(
                f"params: param_groups[{group_index}]['params'][{index}] has dtype {p.dtype}; DirectML's "
                "ADAM_OPTIMIZER takes FLOAT32 or FLOAT16 tensors only (use dml_optim.Adam for other dtypes)"
            )

    def _check_options(self, group: dict[str, Any]) -> None:
        super()._check_options(group)
        for key in ("state_dtype", "compute_dtype"):
            if group[key] not in (None, torch.float32, torch.float16):
                raise TypeError(f"{key}={group[key]} is not supported by DmlAdam: DirectML's ADAM_OPTIMIZER takes FLOAT32 or FLOAT16 only")

    def _plan(self, group_index: int, group: dict[str, Any]):
        plan = super()._plan(group_index, group)
        for flat, (has_grad, _, _) in zip(self._flats[group_index], plan):
            for i, active in enumerate(has_grad):
                if active and flat.device_steps is None and flat.steps[i] + self.step_offset > UINT32_MAX:
                    raise OverflowError(
                        f"DmlAdam: the training step would reach {flat.steps[i] + self.step_offset}, beyond "
                        f"DirectML's UINT32 TrainingStepTensor (max {UINT32_MAX}); nothing was updated"
                    )
        return plan

    def _constants(self, group):
        return {"alpha": group["beta1"], "beta": group["beta2"], "epsilon": group["epsilon"]}

    def _coefficients(self, group, T):
        return F.dml_adam_coefficients(group["lr"], T, beta1=group["beta1"], beta2=group["beta2"])

    def _rule(self, x, g, states, scalars, scratch):
        F.adam_(x, g, *states, scratch=scratch[0], **scalars)

    @staticmethod
    def _from_torch_group(saved: dict[str, Any]) -> dict[str, Any]:
        out = {}
        if "betas" in saved:
            out["beta1"], out["beta2"] = (float(b) for b in saved["betas"])
        return out

    def dml_descriptors(self) -> list[dict[str, Any]]:
        """The ADAM_OPTIMIZER descriptor of every flat buffer, in the JSON form of
        ``dml-optim validate`` (in-place bindings included), each validated.

        A buffer larger than 2**32 - 1 elements is described as several
        operators (``split_for_dml``).  Raises ``ValueError`` if a descriptor
        violates a DirectML rule.
        """
        from dml_optim.dml import adam_descriptor, dumps, split_for_dml, validate

        out = []
        for gi, (group, flats) in enumerate(zip(self.param_groups, self._flats)):
            for fi, flat in enumerate(flats):
                if flat.master is not None or self._state_dtype(group, flat) != flat.dtype:
                    raise ValueError(
                        f"param_groups[{gi}] buffer {fi}: parameters are {flat.dtype} but the moments are "
                        f"{self._state_dtype(group, flat)}{' with master weights' if flat.master is not None else ''}; "
                        "DirectML's ADAM_OPTIMIZER needs all seven tensors in one data type, so this "
                        "configuration has no single-operator DirectML form"
                    )
                dtype = {torch.float32: "FLOAT32", torch.float16: "FLOAT16"}[flat.dtype]
                steps = flat.device_steps.tolist() if flat.device_steps is not None else flat.steps
                prefix = f"param_groups[{gi}].buffer{fi}"
                names = {role: f"{prefix}.{role}" for role in ("parameters", "first_moment", "second_moment", "gradient", "training_step")}
                offset = 0
                for n in split_for_dml(flat.numel):
                    desc = adam_descriptor(
                        n, dtype, learning_rate=float(group["lr"]), beta1=group["beta1"], beta2=group["beta2"],
                        epsilon=group["epsilon"], training_step=max(steps) + self.step_offset,
                        buffer_names=names, element_offset=offset,
                    )
                    offset += n
                    report = validate(desc)
                    if not report.valid:
                        raise ValueError(f"DmlAdam built an invalid descriptor for {prefix}: {report.errors[0].message}")
                    out.append(json.loads(dumps(desc)))
        return out
