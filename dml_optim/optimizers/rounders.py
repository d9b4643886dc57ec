"""The stochastic rounders of an optimizer (``rounding="stochastic"``): one per device, kept beside it.

A :class:`~dml_optim.core.rounding.StochasticRounder` (a ``torch.Generator`` and the rounding's scratch) writes
the updated float16/bfloat16 parameters of every buffer of one optimizer on one device.  The rounders live in
a table beside the optimizer, not in it: a copy of the optimizer makes its own (seeded the same way), and
``state_dict`` carries the generators' states (:func:`rounding_state`, :func:`load_rounding_state`), so a
resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dml_optim.core.flat import describe_param, local_tensor
from dml_optim.core.options import LOW_PRECISION_DTYPES
from dml_optim.core.rounding import StochasticRounder

__all__ = ["rounder", "rounding_state", "check_rounding_state", "load_rounding_state", "check_rounding"]

_ROUNDERS: "weakref.WeakKeyDictionary[Any, dict[str, StochasticRounder]]" = weakref.WeakKeyDictionary()


def rounder(opt, device: torch.device) -> StochasticRounder:
    """``opt``'s stochastic rounder on ``device``, made the first time: its generator seeded from
    ``torch.initial_seed()`` (``torch.manual_seed`` makes a run reproducible; nothing is drawn from torch's
    default generator, so a model's own random numbers are those of ``rounding="nearest"``)."""
    rounders = _ROUNDERS.setdefault(opt, {})
    key = str(device)
    if key not in rounders:
        rounders[key] = StochasticRounder(device, (torch.initial_seed() + 0x5EED * len(rounders)) % (1 << 63))
    return rounders[key]


def rounding_state(opt) -> dict[str, torch.Tensor]:
    """The generator states of ``opt``'s rounders, by device name (empty without ``rounding="stochastic"``)."""
    return {key: r.get_state() for key, r in _ROUNDERS.get(opt, {}).items()}


def check_rounding_state(saved: dict[str, torch.Tensor] | None) -> str | None:
    """Why generator states saved by :func:`rounding_state` cannot be restored here (a device this torch has no
    generator for, a state of another size), or None: each is set into a trial generator, nothing else."""
    for key, state in (saved or {}).items():
        try:
            torch.Generator(device=torch.device(key)).set_state(state.to("cpu", torch.uint8))
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"the generator state of device {key!r} ({state.numel()} bytes) cannot be restored here: {exc}"
    return None


def load_rounding_state(opt, saved: dict[str, torch.Tensor] | None) -> None:
    """Restore generator states saved by :func:`rounding_state` (``load_state_dict``); a device without a
    rounder yet gets its rounder now."""
    for key, state in (saved or {}).items():
        rounder(opt, torch.device(key)).set_state(state)


def check_rounding(group: dict[str, Any], gi: int) -> None:
    """``rounding="stochastic"`` rounds float16/bfloat16 parameters: any other trainable one is refused, named
    (as ``kahan=True`` refuses it)."""
    if group.get("rounding") != "stochastic":
        return
    for i, p in enumerate(group["params"]):
        if p.requires_grad and local_tensor(p).dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(f'rounding="stochastic" rounds float16 or bfloat16 parameters, got {p.dtype} '
                             f"({describe_param(p, i, gi)}); convert the model first (model.bfloat16()) or put "
                             'these parameters in a param group of their own with rounding="nearest"')
