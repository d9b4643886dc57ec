"""ONNX-spec Momentum (``ai.onnx.preview.training::Momentum``), flat and in place."""

from __future__ import annotations

from typing import Any

from dml_optim import functional as F
from dml_optim.optimizers.base import FlatOptimizer

__all__ = ["Momentum"]


class Momentum(FlatOptimizer):
    r"""SGD with momentum as the ONNX ``Momentum-1`` operator defines it.

    Per step, with ``T`` = completed steps (0 on the first step) and
    ``G_reg = norm_coefficient * X + G``::

        V = alpha * V + (beta if T > 0 else 1) * G_reg
        standard: X = X - lr * V
        nesterov: X = X - lr * (G_reg + alpha * V)

    Spec: ONNX ``ai.onnx.preview.training`` ``Momentum`` version 1.

    Mapping: ``mode="standard"`` is ``torch.optim.SGD(lr, momentum=alpha,
    dampening=1 - beta, weight_decay=norm_coefficient)``; ``mode="nesterov"``
    with ``beta=1`` is ``SGD(..., nesterov=True, dampening=0)``.  The state
    ``momentum_buffer`` is ONNX ``V``.
    """

    state_names = ("momentum_buffer",)
    step_offset = 0
    #: Hyperparameter ranges, checked (and stored as floats) by the base class.
    hyperparameter_ranges = {
        "lr": dict(low=0.0),
        "alpha": dict(low=0.0, high=1.0),
        "beta": dict(low=0.0, high=1.0),
        "norm_coefficient": dict(low=0.0),
    }
    skip_identity = {"lr": 0.0, "alpha": 1.0, "grad_scale": 0.0, "norm_coefficient": 0.0}

    def __init__(
        self,
        params,
        lr: float,
        *,
        alpha: float = 0.9,
        beta: float = 1.0,
        mode: str = "standard",
        norm_coefficient: float = 0.0,
        backend: str = "auto",
        state_dtype=None,
        compute_dtype=None,
        master_weights: bool = False,
        nonfinite: str = "propagate",
        atomic: bool = False,
    ):
        defaults = dict(lr=lr, alpha=alpha, beta=beta, mode=mode, norm_coefficient=norm_coefficient)
        super().__init__(
            params, defaults, backend=backend, state_dtype=state_dtype,
            compute_dtype=compute_dtype, master_weights=master_weights, nonfinite=nonfinite,
            atomic=atomic,
        )

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        super()._check_hyperparameters(group)
        if group["mode"] not in F.MOMENTUM_MODES:
            raise ValueError(f"mode must be 'standard' or 'nesterov', got {group['mode']!r}")

    def _constants(self, group):
        return {"alpha": group["alpha"], "norm_coefficient": group["norm_coefficient"], "nesterov": group["mode"] == "nesterov"}

    def _coefficients(self, group, T):
        return F.momentum_coefficients(group["lr"], T, beta=group["beta"])

    def _rule(self, x, g, states, scalars, scratch):
        F.momentum_(x, g, *states, scratch=scratch[0], **scalars)

    @staticmethod
    def _from_torch_group(saved: dict[str, Any]) -> dict[str, Any]:
        out = {}
        if "momentum" in saved:
            out["alpha"] = float(saved["momentum"])
        if "dampening" in saved:
            out["beta"] = 1.0 - float(saved["dampening"])
        if "nesterov" in saved:
            out["mode"] = "nesterov" if saved["nesterov"] else "standard"
        if "weight_decay" in saved:
            out["norm_coefficient"] = float(saved["weight_decay"])
        return out
