"""ONNX-spec Adam (``ai.onnx.preview.training::Adam``), flat and in place."""

from __future__ import annotations

from typing import Any

from dml_optim import functional as F
from dml_optim.optimizers.base import FlatOptimizer

__all__ = ["Adam"]


class Adam(FlatOptimizer):
    r"""Adam as the ONNX ``Adam-1`` operator defines it.

    Per step, with ``T`` = completed steps + 1 and ``G_reg = norm_coefficient * X + G``::

        V = alpha * V + (1 - alpha) * G_reg
        H = beta * H + (1 - beta) * G_reg * G_reg
        X = X - lr * sqrt(1 - beta**T) / (1 - alpha**T) * V / (sqrt(H) + epsilon)
        X = (1 - norm_coefficient_post) * X

    Spec: ONNX ``ai.onnx.preview.training`` ``Adam`` version 1 (``R`` = ``lr``;
    ``T`` starts at 1 because ONNX disables bias correction at ``T = 0``).

    Mapping to ``torch.optim.Adam(lr, betas=(alpha, beta), eps, weight_decay=norm_coefficient)``:
    identical when ``epsilon == 0``.

    .. warning:: Epsilon is added to the *uncorrected* ``sqrt(H)``; torch.optim
       adds it to ``sqrt(H / (1 - beta**T))``. With ``epsilon > 0`` the two differ,
       most in the first steps.  ``norm_coefficient_post`` is a decoupled decay
       applied after the update (``AdamW`` decays before, by ``lr * weight_decay``).

    State names follow torch.optim (``exp_avg`` = ONNX ``V``, ``exp_avg_sq`` = ONNX ``H``),
    so a ``torch.optim.Adam`` state dict loads into this class (see ``load_state_dict``).

    Args:
        params: parameters or param-group dicts.
        lr: learning rate ``R`` (>= 0).
        alpha: first-moment decay, in [0, 1).
        beta: second-moment decay, in [0, 1).
        epsilon: added to ``sqrt(H)`` (>= 0).
        norm_coefficient: L2 coefficient added to the gradient (>= 0).
        norm_coefficient_post: decay of the updated parameters, in [0, 1].
        backend: ``"auto"``, ``"eager"`` or ``"compiled"``.
        state_dtype, compute_dtype, master_weights: precision options, see README.
        nonfinite: ``"propagate"``, ``"skip"`` or ``"raise"``.
        atomic: roll a step back if it fails mid-update (one extra copy per step).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    step_offset = 1
    #: Hyperparameter ranges, checked (and stored as floats) by the base class.
    hyperparameter_ranges = {
        "lr": dict(low=0.0),
        "alpha": dict(low=0.0, high=1.0, high_open=True),
        "beta": dict(low=0.0, high=1.0, high_open=True),
        "epsilon": dict(low=0.0),
        "norm_coefficient": dict(low=0.0),
        "norm_coefficient_post": dict(low=0.0, high=1.0),
    }
    skip_identity = {"epsilon": 1.0, "step_size": 0.0, "alpha": 1.0, "beta": 1.0, "norm_coefficient": 0.0, "norm_coefficient_post": 0.0}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        alpha: float = 0.9,
        beta: float = 0.999,
        epsilon: float = 1e-6,
        norm_coefficient: float = 0.0,
        norm_coefficient_post: float = 0.0,
        backend: str = "auto",
        state_dtype=None,
        compute_dtype=None,
        master_weights: bool = False,
        nonfinite: str = "propagate",
        atomic: bool = False,
    ):
        defaults = dict(
            lr=lr, alpha=alpha, beta=beta, epsilon=epsilon,
            norm_coefficient=norm_coefficient, norm_coefficient_post=norm_coefficient_post,
        )
        super().__init__(
            params, defaults, backend=backend, state_dtype=state_dtype,
            compute_dtype=compute_dtype, master_weights=master_weights, nonfinite=nonfinite,
            atomic=atomic,
        )

    def _scratch_count(self, group, gated: bool) -> int:
        return 2 if group["norm_coefficient"] and gated else 1

    def _constants(self, group):
        return {k: group[k] for k in ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")}

    def _coefficients(self, group, T):
        return F.adam_coefficients(group["lr"], T, alpha=group["alpha"], beta=group["beta"])

    def _rule(self, x, g, states, scalars, scratch):
        F.adam_(x, g, *states, scratch=scratch[0], scratch2=scratch[1] if len(scratch) > 1 else None, **scalars)

    @staticmethod
    def _from_torch_group(saved: dict[str, Any]) -> dict[str, Any]:
        """Hyperparameters of a ``torch.optim.Adam`` param group, in our names."""
        out = {}
        if "betas" in saved:
            out["alpha"], out["beta"] = (float(b) for b in saved["betas"])
        if "weight_decay" in saved:
            out["norm_coefficient"] = float(saved["weight_decay"])
        return out
