"""Constants and the runtime options every optimizer takes (a leaf module: it imports only torch).

Two kinds of settings live in a param group:

* **hyperparameters** (``lr``, ``alpha``, ``betas``, ...): the update rule's
  numbers, declared per optimizer in its spec (:mod:`dml_optim.optimizers.spec`);
* **options** (this module): how the rule runs, the same for every optimizer:
  ``backend``, ``state_dtype``, ``state_bits``, ``compute_dtype``, ``master_weights``,
  ``kahan``, ``rounding``, ``nonfinite`` and ``capturable``.

Optimizer-wide settings (``atomic``, ``checks``, ``pack_via``, ``repeat``) are attributes
of the optimizer, not of a group.  :func:`check_options` validates a group's
options in place and returns nothing; every message names the option and the
value.
"""

from __future__ import annotations

import numbers
from typing import Any, TypedDict

import torch

__all__ = [
    "check_state_bits",
    "STATE_BITS",
    "BACKENDS",
    "NONFINITE_MODES",
    "ROUNDING_MODES",
    "CHECK_MODES",
    "PACK_MODES",
    "SUPPORTED_DTYPES",
    "LOW_PRECISION_DTYPES",
    "CHUNK_ELEMENTS",
    "STATE_DICT_FORMAT_VERSION",
    "MAX_STEP",
    "OPTION_DEFAULTS",
    "OPTION_NAMES",
    "dtype_option",
    "OptimizerOptions",
    "check_options",
    "check_flag",
    "check_choice",
]

#: ``state_bits=``: full-precision states (None), or 8-bit / 4-bit block-quantized ones (dml_optim.core.quant).
STATE_BITS = (None, 8, 4)
#: ``backend=``: the eager op chain, the torch.compile'd kernel, torch's fused CPU kernel of the same rule,
#: or the choice by device, settings and size.
BACKENDS = ("auto", "eager", "compiled", "fused")
#: ``nonfinite=``: what a step does with inf/NaN gradients.
NONFINITE_MODES = ("propagate", "skip", "raise")
#: ``rounding=``: how an update computed in FP32 is written into float16/bfloat16 parameters: to the nearest
#: value (the format's own conversion), or stochastically (:mod:`dml_optim.core.rounding`: unbiased, no
#: compensation buffer; an alternative to ``kahan=True`` and ``master_weights=True``).
ROUNDING_MODES = ("nearest", "stochastic")
#: ``checks=``: how a step finds out whether parameters or gradients were re-bound (``FlatBuffer.check``):
#: storage use counts and every parameter (the default), the counts alone (O(1)), or the counts and the first
#: and last parameter.
CHECK_MODES = ("full", "refs", "fast")
#: ``pack_via=``: where packing copies go through ("auto": host memory off the CPU, bounded peak).
PACK_MODES = ("auto", "device", "host")
#: Parameter dtypes the optimizers accept.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Dtypes that master weights and Kahan summation apply to.
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
#: Elements per chunk when the rule runs in a wider compute dtype than storage (eager backend).
CHUNK_ELEMENTS = 1 << 20
#: Version of the layout ``state_dict()`` writes under ``state_dict()["dml_optim"]``.
#: Version 0 is torch.optim's layout (no ``dml_optim`` key), which still loads.
STATE_DICT_FORMAT_VERSION = 1
#: Largest step count held (every whole number up to it is exact in float64).
MAX_STEP = 2**53

#: Per-group options and their defaults.
OPTION_DEFAULTS: dict[str, Any] = {
    "backend": "auto",
    "state_dtype": None,
    "state_bits": None,
    "compute_dtype": None,
    "master_weights": False,
    "kahan": False,
    "rounding": "nearest",
    "nonfinite": "propagate",
    "capturable": False,
}
OPTION_NAMES = tuple(OPTION_DEFAULTS)


class OptimizerOptions(TypedDict, total=False):
    """The keyword options every optimizer accepts after its hyperparameters.

    Per group (also accepted in ``add_param_group`` dicts): ``backend``
    (``"auto"``, ``"eager"``, ``"compiled"``, ``"fused"``), ``state_dtype``, ``state_bits``
    (None, 8 or 4: block-quantized states),
    ``compute_dtype``, ``master_weights``, ``kahan``, ``rounding`` (``"nearest"``, ``"stochastic"``), ``nonfinite``
    (``"propagate"``, ``"skip"``, ``"raise"``), ``capturable``.  Optimizer-wide:
    ``atomic`` (roll a failed step back), ``checks`` (``"full"``, ``"refs"``, ``"fast"``),
    ``pack_via`` (``"auto"``, ``"device"``, ``"host"``), ``repeat`` (True: a steady step repeats the last
    one's plan; False: every step plans from scratch, the path a repeat must equal bit for bit).
    """

    backend: str
    state_dtype: "torch.dtype | str | None"
    state_bits: "int | None"
    compute_dtype: "torch.dtype | str | None"
    master_weights: bool
    kahan: bool
    rounding: str
    nonfinite: str
    capturable: bool
    atomic: bool
    checks: str
    pack_via: str
    repeat: bool


def dtype_option(name: str, value) -> torch.dtype | None:
    """``value`` (a torch dtype, its name such as ``"float16"``, or None) as a dtype or None."""
    if value is None:
        return None
    if isinstance(value, str):
        value = getattr(torch, value.replace("torch.", ""), value)
    if not isinstance(value, torch.dtype) or value not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be one of float16, bfloat16, float32, float64 or None, got {value!r}")
    return value


def check_flag(name: str, value) -> bool:
    """A bool option; anything else is a ``TypeError`` naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else a ``ValueError`` naming ``name`` and the value."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_state_bits(bits) -> None:
    """``state_bits`` is None, 8 or 4 (a bool, a tensor or any other object is refused, naming it)."""
    if bits is not None and (not isinstance(bits, numbers.Integral) or isinstance(bits, bool) or bits not in STATE_BITS):
        raise ValueError(f"state_bits must be None, 8 or 4, got {bits!r}")


def check_options(group: dict[str, Any]) -> None:
    """Validate and normalize the options of ``group`` in place (dtype names become dtypes).

    Checks each option alone and the combinations that can't work whatever
    the parameters are; parameter-dependent checks (master weights need
    float16/bfloat16 parameters) are the optimizer's.
    """
    check_choice("backend", group["backend"], BACKENDS)
    check_choice("nonfinite", group["nonfinite"], NONFINITE_MODES)
    check_choice("rounding", group.setdefault("rounding", "nearest"), ROUNDING_MODES)
    for key in ("state_dtype", "compute_dtype"):
        group[key] = dtype_option(key, group[key])
    check_state_bits(group["state_bits"])
    for key in ("master_weights", "kahan", "capturable"):
        check_flag(key, group[key])
    if group["master_weights"] and group["kahan"]:
        raise ValueError(
            "master_weights=True and kahan=True are alternatives (an FP32 master copy, or an FP16/BF16 "
            "compensation buffer); choose one"
        )
    if group["rounding"] == "stochastic" and (group["kahan"] or group["master_weights"]):
        option = "kahan=True" if group["kahan"] else "master_weights=True"
        raise ValueError(
            f'rounding="stochastic" and {option} are alternatives (stochastic rounding keeps the updates of '
            "float16/bfloat16 parameters in expectation with no extra buffer; Kahan summation keeps a compensation "
            f'buffer, master weights an FP32 copy); choose one: drop {option} or use rounding="nearest"')
    if group["rounding"] == "stochastic" and group["backend"] == "compiled":
        raise ValueError('rounding="stochastic" runs on the eager backend (the rounding draws from the optimizer\'s '
                         'generator, which a compiled kernel does not take): use backend="auto" or backend="eager"')
    if group["capturable"] and group["nonfinite"] == "raise":
        raise ValueError("capturable=True and nonfinite='raise' cannot be combined: 'raise' reads a flag on the host every step")

