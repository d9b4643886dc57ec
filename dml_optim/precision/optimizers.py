"""The optimizers the precision harness runs, built from the registry, and the facts its metrics read.

:func:`make_optimizer` builds a registry optimizer in a :class:`Config`
(always the eager backend: the op chain DirectML runs);
:func:`reference_optimizer` builds the float64 reference;
:func:`resolved_hyperparameters` says which hyperparameters a run uses.
:func:`second_moment` and :func:`epsilon_name` read, from an optimizer's
declared torch.optim names, which state is its second moment and which
hyperparameter is its epsilon, so no table here lists optimizers by name.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from dml_optim.optimizers import FlatOptimizer, registry
from dml_optim.optimizers.registry import epsilon_name, ours_for_torch  # (re-exported: precision's public names)
from dml_optim.precision.configs import REFERENCE, Config

__all__ = [
    "make_optimizer", "reference_optimizer", "reference_description", "resolved_hyperparameters", "second_moment",
    "epsilon_name",
]


def make_optimizer(name: str, params: Iterable, config: Config,
                   hyperparameters: dict[str, Any] | None = None) -> FlatOptimizer:
    """The registry's optimizer ``name`` over ``params`` with ``config``'s precision options.

    Always the ``eager`` backend: the op chain DirectML runs, each op's
    result rounded to the compute dtype (a fused, compiled kernel would keep
    FP16 intermediates in FP32 registers and hide what FP16 arithmetic costs).

    Raises the optimizer's own error for an unsupported combination (e.g.
    ``TypeError`` for ``DmlAdam`` with bfloat16).
    """
    hyper = dict(hyperparameters or {})
    registry.check_hyperparameters(name, hyper)
    return registry.build(name, params, **hyper, **config.options(), backend="eager")


def resolved_hyperparameters(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every hyperparameter a run of ``name`` uses: the class defaults, the registry's learning
    rate where the class has none, then ``overrides`` (checked: an unknown name is a ``TypeError``,
    a value out of range a ``ValueError``, each naming the hyperparameter)."""
    spec = registry.spec(name)
    overrides = dict(overrides or {})
    registry.check_hyperparameters(name, overrides)
    hyper = {**spec.defaults(), "lr": registry.lr_for(name), **overrides}
    spec.check(hyper)
    return hyper


def reference_optimizer(name: str, params: Iterable, hyperparameters: dict[str, Any] | None = None) -> FlatOptimizer:
    """The float64 reference: the same rule with float64 parameters and states.

    An optimizer without float64 (``DmlAdam``: DirectML has none) is
    referenced by :class:`~dml_optim.Adam` with ``alpha=beta1, beta=beta2``:
    the same rule for ``T >= 1`` (docs/design.md §2), both from
    :func:`dml_optim.core.functional.adam_`.
    """
    if _has_float64(name):
        return make_optimizer(name, params, REFERENCE, hyperparameters)
    hyper = resolved_hyperparameters(name, hyperparameters)
    return registry.build("adam", params, lr=hyper["lr"], alpha=hyper["beta1"], beta=hyper["beta2"],
                          epsilon=hyper["epsilon"], backend="eager")


def reference_description(name: str) -> str:
    """What :func:`reference_optimizer` builds for ``name``, in words (for the reports)."""
    if _has_float64(name):
        return "the same update rule in float64"
    return "the same update rule in float64 (dml_optim.Adam with alpha=beta1, beta=beta2: identical for T >= 1)"


def _has_float64(name: str) -> bool:
    return torch.float64 in registry.get(name).dtypes


def second_moment(name: str) -> tuple[str | None, str | None]:
    """``(state, decay)``: the state holding ``name``'s second moment and the hyperparameter it decays by.

    Read from torch.optim's names, which the states and specs use:
    ``exp_avg_sq`` decays by ``betas[1]`` (``v = b2 * v + (1 - b2) * g * g``),
    ``sum`` accumulates ``g * g`` (decay None); ``(None, None)`` for an
    optimizer without a second moment (Momentum).
    """
    states = registry.get(name).state_names
    if "exp_avg_sq" in states:
        return "exp_avg_sq", ours_for_torch(name, "betas")[1]
    if "sum" in states:
        return "sum", None
    return None, None


