"""ONNX-spec Adagrad (``ai.onnx.preview.training::Adagrad``), flat and in place."""

from __future__ import annotations

from typing import Any

from dml_optim import functional as F
from dml_optim.optimizers.base import FlatOptimizer

__all__ = ["Adagrad"]


class Adagrad(FlatOptimizer):
    r"""Adagrad as the ONNX ``Adagrad-1`` operator defines it.

    Per step, with ``T`` = completed steps (0 on the first step, as the ONNX
    text asks) and ``G_reg = norm_coefficient * X + G``::

        r = lr / (1 + T * decay_factor)
        H = H + G_reg * G_reg
        X = X - r * G_reg / (sqrt(H) + epsilon)

    Spec: ONNX ``ai.onnx.preview.training`` ``Adagrad`` version 1.

    Mapping: identical to ``torch.optim.Adagrad(lr, lr_decay=decay_factor,
    eps=epsilon, weight_decay=norm_coefficient)`` (state ``sum`` = ONNX ``H``).

    .. note:: The default ``epsilon`` is ``1e-10`` (torch's), not ONNX's 0:
       with epsilon 0 a parameter whose gradient has always been zero gets
       ``0 / 0`` = NaN.  Pass ``epsilon=0.0`` for the literal ONNX default.
    """

    state_names = ("sum",)
    step_offset = 0
    #: Hyperparameter ranges, checked (and stored as floats) by the base class.
    hyperparameter_ranges = {
        "lr": dict(low=0.0),
        "decay_factor": dict(low=0.0),
        "epsilon": dict(low=0.0),
        "norm_coefficient": dict(low=0.0),
    }
    skip_identity = {"epsilon": 1.0, "rate": 0.0, "norm_coefficient": 0.0}

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        *,
        decay_factor: float = 0.0,
        epsilon: float = 1e-10,
        norm_coefficient: float = 0.0,
        backend: str = "auto",
        state_dtype=None,
        compute_dtype=None,
        master_weights: bool = False,
        nonfinite: str = "propagate",
        atomic: bool = False,
    ):
        defaults = dict(lr=lr, decay_factor=decay_factor, epsilon=epsilon, norm_coefficient=norm_coefficient)
        super().__init__(
            params, defaults, backend=backend, state_dtype=state_dtype,
            compute_dtype=compute_dtype, master_weights=master_weights, nonfinite=nonfinite,
            atomic=atomic,
        )

    def _scratch_count(self, group, gated: bool) -> int:
        return 2 if group["norm_coefficient"] else 1

    def _constants(self, group):
        return {"epsilon": group["epsilon"], "norm_coefficient": group["norm_coefficient"]}

    def _coefficients(self, group, T):
        return F.adagrad_coefficients(group["lr"], T, decay_factor=group["decay_factor"])

    def _rule(self, x, g, states, scalars, scratch):
        F.adagrad_(x, g, *states, scratch=scratch[0], scratch2=scratch[1] if len(scratch) > 1 else None, **scalars)

    @staticmethod
    def _from_torch_group(saved: dict[str, Any]) -> dict[str, Any]:
        names = {"lr_decay": "decay_factor", "eps": "epsilon", "weight_decay": "norm_coefficient"}
        return {ours: float(saved[theirs]) for theirs, ours in names.items() if theirs in saved}
