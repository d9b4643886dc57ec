"""An optimizer's update as a value: :class:`Rule`, what backends and the rest of ``core`` receive.

An optimizer describes its update once, as a :class:`Rule` (a frozen dataclass of plain data and pure
functions): its per-step scalars (``constants`` of the hyperparameters, ``coefficients`` after ``T`` steps),
the element-wise update (``apply``, in place over one range of the flat buffers), its states, its step
counting, its scratch, and torch's fused kernel where torch has one.  The backends
(:mod:`dml_optim.backends`) and :mod:`dml_optim.core.update` take the rule and a step's request; they never
call into an optimizer class or instance.  The optimizer class (:class:`dml_optim.FlatOptimizer`) holds its
rule as ``rule`` and adds the rest: hyperparameter validation, torch's names, state dicts.

Writing an optimizer: docs/guide/writing-an-optimizer.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from dml_optim.core.options import MAX_STEP, SUPPORTED_DTYPES

__all__ = ["Rule", "no_constants"]


def no_constants(hyper: Mapping[str, Any]) -> dict[str, Any]:
    """The ``constants`` of a rule that has none."""
    return {}


@dataclass(frozen=True, eq=False)
class Rule:
    """One optimizer's update, as data (compared and hashed by identity: one rule per optimizer class, the key of its
    compiled kernels).

    Attributes:
        name: the optimizer's name (messages, compiled kernels' names).
        apply: ``apply(x, g, *states, scratch, **scalars)``: the update of one range, in place on ``x`` (the
            parameters, or their float32 master copy) and the states, with the functions of
            :mod:`dml_optim.core.functional` (every op native on DirectML); ``scratch`` is a list of
            :attr:`scratch_slots` tensors the size of the range (or None: allocate, or fuse).
        coefficients: ``coefficients(hyper, T) -> {name: scalar}``: the per-step scalars after ``T`` steps (``T`` a
            number, or a 0-d tensor on the device when the count lives there: gated and capturable steps; in a
            masked update, parameters at several counts at once, a tensor of one count per element, so
            :attr:`apply` must take its scalars as numbers or as tensors that broadcast over the range).
        constants: ``constants(hyper) -> {name: scalar}``: the scalars that do not change with the step.
        states: the per-parameter state tensors, by torch.optim's names (``exp_avg``, ...).
        states_for: ``states_for(hyper)``: the states under these hyperparameters when they depend on them
            (AdamW's ``amsgrad`` adds ``max_exp_avg_sq``); None: :attr:`states`.
        unsigned_states: states that are never negative (quantized without a sign, ``state_bits``).
        step_offset: ``T`` passed to :attr:`coefficients` = completed steps + this.
        max_step, max_step_reason: the largest count a parameter may reach, and why.
        dtypes: the parameter dtypes the rule accepts.
        skip_identity: scalars whose value makes a step an exact no-op (a gated step that is skipped).
        zero_skips: float hyperparameters whose exact zero removes ops (a structural choice: a compiled kernel
            without them).
        scratch_slots: the length of the ``scratch`` list :attr:`apply` gets (slots past those it is given are
            None; a gated step may fill more, see :mod:`dml_optim.core.update`).
        scratch_for: ``scratch_for(hyper, gated) -> int``: the full-size scratch tensors the eager step keeps
            for :attr:`apply` under these hyperparameters (None: 1).
        fused: ``fused(hyper, count) -> (torch kernel name, keywords) | None``: torch's fused CPU kernel of the same
            update after ``count`` completed steps (``torch._fused_adamw_``'s name and keywords), or None where
            torch has none for these hyperparameters; None: never.
        fused_counts: how :attr:`fused`'s keywords depend on the count: ``"none"``, ``"first"`` (step 1 apart) or
            ``"each"``.
        floats: the float hyperparameters (a compiled kernel's scalar arguments); filled in from the optimizer's
            spec when left empty.
        switches: the other hyperparameters (bools, choices: a compiled kernel's structure); filled in likewise.
        initial: ``initial(hyper, state) -> float``: the value a state starts at (None: 0; Adagrad's sum starts at
            ``initial_accumulator_value``).
    """

    name: str
    apply: Callable[..., None]
    coefficients: Callable[[Mapping[str, Any], Any], dict[str, Any]]
    constants: Callable[[Mapping[str, Any]], dict[str, Any]] = no_constants
    states: tuple[str, ...] = ()
    states_for: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    unsigned_states: tuple[str, ...] = ()
    step_offset: int = 0
    max_step: int = MAX_STEP
    max_step_reason: str = "step counts are saved as float64, exact to 2**53"
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    skip_identity: Mapping[str, float] = field(default_factory=dict)
    zero_skips: tuple[str, ...] = ()
    scratch_slots: int = 1
    scratch_for: Callable[[Mapping[str, Any], bool], int] | None = None
    fused: Callable[[Mapping[str, Any], int], tuple[str, dict[str, Any]] | None] | None = None
    fused_counts: str = "each"
    floats: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    initial: Callable[[Mapping[str, Any], str], float] | None = None

    def __post_init__(self) -> None:
        if self.fused_counts not in ("none", "first", "each"):
            raise ValueError(f"fused_counts must be 'none', 'first' or 'each', got {self.fused_counts!r}")
        if not callable(self.apply) or not callable(self.coefficients) or not callable(self.constants):
            raise TypeError(f"{self.name}: apply, coefficients and constants must be callables")

    def __deepcopy__(self, memo) -> "Rule":  # (a value: a copied optimizer shares its class's rule, and kernels)
        return self

    def group_state_names(self, hyper: Mapping[str, Any]) -> tuple[str, ...]:
        """The states under ``hyper`` (:attr:`states_for`, else :attr:`states`)."""
        return self.states_for(hyper) if self.states_for is not None else self.states

    def scratch_count(self, hyper: Mapping[str, Any], gated: bool) -> int:
        """The scratch tensors :attr:`apply` takes under ``hyper`` (a gated step may need more)."""
        return self.scratch_for(hyper, gated) if self.scratch_for is not None else 1

    def initial_state(self, hyper: Mapping[str, Any], name: str) -> float:
        """The value state ``name`` starts at under ``hyper`` (:attr:`initial`, else 0)."""
        return self.initial(hyper, name) if self.initial is not None else 0.0

    def fused_kernel(self, hyper: Mapping[str, Any], count: int) -> tuple[str, dict[str, Any]] | None:
        """torch's fused kernel and its keywords after ``count`` completed steps, or None (:attr:`fused`)."""
        return self.fused(hyper, count) if self.fused is not None else None
