"""The dtype rules of a param group's precision options, and the ranges a step's numbers must fit.

Functions of a group's settings (``state_dtype``, ``compute_dtype``, ``master_weights``, ``kahan``,
``state_bits``) and a buffer's parameter dtype, used alike by the optimizers (allocation, the state dict)
and every backend (:mod:`dml_optim.backends`):

* :func:`state_dtype`: states are FP32 with master weights or Kahan unless ``state_dtype`` says otherwise;
* :func:`compute_dtype`: ``compute_dtype``, else FP32 (at least) with master weights, Kahan or quantized
  states, else the parameters';
* :func:`master_dtype`: the master copy's dtype (the compute dtype, at least FP32);
* :func:`converts`: whether the eager rule needs converted operands (it then runs in chunks);
* :func:`check_step_limit`, :func:`check_range`: a step count the class can represent, per-step scalars
  the compute dtype holds (checked before any write).
"""

from __future__ import annotations

from typing import Any

import torch

from dml_optim.core.options import LOW_PRECISION_DTYPES
from dml_optim.core.packing import describe_param, local_tensor

__all__ = ["PRECISION_OPTIONS", "precision", "state_dtype", "compute_dtype", "widened", "master_dtype", "converts",
           "dtype_limit", "check_step_limit", "check_range", "check_directml_dtypes", "DIRECTML_HALF"]

#: What DirectML's half precision is, for the messages that refuse bfloat16 there.
DIRECTML_HALF = ('float16 parameters with rounding="stochastic" (DirectML\'s half-precision format, for the memory '
                 'bfloat16 would save), or float32')

#: The options :func:`precision` reads, in its order (the states are allocated for these).
PRECISION_OPTIONS = ("state_dtype", "compute_dtype", "master_weights", "kahan", "state_bits", "rounding")

#: The largest finite value of each compute dtype (``torch.finfo`` is not free on every step).
_LIMITS: dict[torch.dtype, float] = {}


def precision(group) -> tuple:
    """The precision options of ``group`` (:data:`PRECISION_OPTIONS`), as a tuple."""
    return (group["state_dtype"], group["compute_dtype"], group["master_weights"], group["kahan"],
            group["state_bits"], group.get("rounding", "nearest"))


def state_dtype(group, dtype: torch.dtype) -> torch.dtype:
    """States are FP32 with master weights, Kahan or stochastic rounding unless ``state_dtype`` says otherwise."""
    if group["state_dtype"] is not None:
        return group["state_dtype"]
    return torch.float32 if widened(group) else dtype


def compute_dtype(group, dtype: torch.dtype, bits: int | None = None) -> torch.dtype:
    """Arithmetic dtype: ``compute_dtype``, else FP32 (at least) with master weights, Kahan or quantized
    states (``bits``: the buffer's), else the parameters'."""
    if group["compute_dtype"] is not None:
        return group["compute_dtype"]
    if widened(group):
        sdtype = state_dtype(group, dtype) if not bits else torch.float32
        return torch.float32 if sdtype in LOW_PRECISION_DTYPES else sdtype
    if bits:
        return torch.float64 if dtype == torch.float64 else torch.float32
    return dtype


def widened(group) -> bool:
    """The rule computes in FP32 (at least) whatever the parameters' dtype: master weights, Kahan summation or
    stochastic rounding (``rounding="stochastic"``: the FP32 result is rounded into the parameters)."""
    return group["master_weights"] or group["kahan"] or group.get("rounding") == "stochastic"


def master_dtype(group, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master copy (``master_weights=True``): the compute dtype, at least FP32."""
    cdtype = compute_dtype(group, dtype)
    return torch.float32 if cdtype in LOW_PRECISION_DTYPES else cdtype


def converts(group, flat) -> bool:
    """The eager rule needs converted operands for ``flat`` (it then runs in chunks): quantized states always."""
    cdtype = compute_dtype(group, flat.dtype, flat.bits)
    x_dtype = flat.master.dtype if flat.master is not None else flat.dtype
    return (group["kahan"] or flat.bits is not None or x_dtype != cdtype or flat.dtype != cdtype
            or any(s.dtype != cdtype for s in flat.states.values()))


def dtype_limit(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype``."""
    limit = _LIMITS.get(dtype)
    if limit is None:
        limit = _LIMITS[dtype] = torch.finfo(dtype).max
    return limit


def check_step_limit(rule, count: int) -> None:
    """Refuse a step beyond the count ``rule`` (a :class:`~dml_optim.core.rule.Rule`) can represent (before any
    write)."""
    if count + 1 > rule.max_step:
        raise OverflowError(f"{rule.name}: this would be step {count + 1} of a parameter, beyond the "
                            f"{rule.max_step} steps it can count ({rule.max_step_reason}); nothing was updated")


def check_range(group, flat, scalars: dict[str, Any], cdtype: torch.dtype | None = None) -> None:
    """Refuse per-step scalars the compute dtype of ``flat`` under ``group`` cannot hold (before any write);
    ``cdtype``: that dtype (:func:`compute_dtype`), when the caller keeps it."""
    if cdtype is None:
        cdtype = compute_dtype(group, flat.dtype, flat.bits)
    limit = dtype_limit(cdtype)
    for name, value in scalars.items():
        if isinstance(value, float) and abs(value) > limit:
            raise ValueError(f"{name}={value!r} (from the hyperparameters of this param group) is beyond the "
                             f"range of {cdtype} (max {limit:g}); nothing was updated")


def check_directml_dtypes(group, gi: int) -> None:
    """DirectML has no bfloat16 (torch-directml ends the process on a bfloat16 tensor): a group whose parameters
    are on a DirectML device (``privateuseone``) may neither hold bfloat16 parameters nor ask for bfloat16 states or
    arithmetic; ``ValueError`` naming the parameter or the option and the float16 alternative, before anything is
    allocated."""
    on = [(i, p) for i, p in enumerate(group["params"]) if local_tensor(p).device.type == "privateuseone"]
    if not on:
        return
    for i, p in on:
        if p.dtype == torch.bfloat16:
            raise ValueError(f"DirectML has no bfloat16, got a bfloat16 parameter ({describe_param(p, i, gi)}): "
                             f"use {DIRECTML_HALF}")
    for option in ("state_dtype", "compute_dtype"):
        if group.get(option) == torch.bfloat16:
            raise ValueError(f"{option}=torch.bfloat16: DirectML has no bfloat16 (the parameters are on "
                             f"{local_tensor(on[0][1]).device}; torch-directml ends the process on a bfloat16 tensor): use "
                             f"{option}=torch.float16 or torch.float32, and {DIRECTML_HALF}")