"""The stochastic rounders of an optimizer (``rounding="stochastic"``): one seed, and one rounder per device.

A :class:`~dml_optim.core.rounding.StochasticRounder` (the seed and the rounding's scratch) writes the updated
float16/bfloat16 parameters of every buffer of one optimizer on one device, with counter-based numbers keyed
on ``(seed, stream, step count, element)`` (:mod:`dml_optim.core.rounding`): no ``torch.Generator`` (DirectML
plugins before torch-directml 0.2.5 had none on the device, and ignored seeds).  Each flat buffer draws from
its own stream (:func:`stream_of`).  The rounders live in a table beside the optimizer, not in it: a copy of
the optimizer makes its own (seeded the same way), and ``state_dict`` carries the seed
(:func:`rounding_state`, :func:`load_rounding_state`), so a resumed run draws what an uninterrupted one
would, on any device.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from dml_optim.core.flat import describe_param, local_tensor
from dml_optim.core.options import LOW_PRECISION_DTYPES
from dml_optim.core.rounding import RoundingKey, StochasticRounder

__all__ = ["rounder", "rounding_key", "stream_of", "rounding_state", "check_rounding_state", "load_rounding_state",
           "check_rounding"]

_ROUNDERS: "weakref.WeakKeyDictionary[Any, dict[str, StochasticRounder]]" = weakref.WeakKeyDictionary()
#: each optimizer's seed, once it has one (its first rounder, or a loaded state dict)
_SEEDS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _seed(opt) -> int:
    """``opt``'s seed: ``torch.initial_seed()`` when it first needs one (``torch.manual_seed`` makes a run
    reproducible; nothing is drawn from torch's generators, so a model's own random numbers are those of
    ``rounding="nearest"``), or the one a state dict loaded."""
    seed = _SEEDS.get(opt)
    if seed is None:
        seed = _SEEDS[opt] = torch.initial_seed() % (1 << 63)
    return seed


def rounder(opt, device: torch.device) -> StochasticRounder:
    """``opt``'s stochastic rounder on ``device`` (its scratch lives there), made the first time."""
    rounders = _ROUNDERS.setdefault(opt, {})
    key = str(device)
    found = rounders.get(key)
    if found is None:
        found = rounders[key] = StochasticRounder(device, _seed(opt))
    return found


def stream_of(group_index: int, indices) -> int:
    """A flat buffer's stream: its param group's index and the smallest index of its parameters in the group
    (the same in every run of the same model and in a fresh optimizer loading a checkpoint)."""
    return (group_index << 32) | min(indices)


def rounding_key(opt, group: dict[str, Any], flat) -> RoundingKey:
    """The :class:`~dml_optim.core.rounding.RoundingKey` of ``flat``, a buffer of ``group`` (count and start filled
    in per range; a group being added is the last)."""
    gi = next((i for i, g in enumerate(opt.param_groups) if g is group), len(opt.param_groups))
    return RoundingKey(rounder(opt, flat.device), stream_of(gi, flat.indices), 0, 0)


def rounding_state(opt) -> int | None:
    """``opt``'s seed, once stochastic rounding needed one (None without ``rounding="stochastic"``)."""
    return _SEEDS.get(opt) if opt in _ROUNDERS else None


def check_rounding_state(saved) -> str | None:
    """Why a seed saved by :func:`rounding_state` cannot be used (not an integer), or None."""
    if saved is None or (isinstance(saved, int) and not isinstance(saved, bool)):
        return None
    return f"the rounding seed must be an int, got {type(saved).__name__}"


def load_rounding_state(opt, saved: int | None, legacy: bool = False) -> None:
    """Take the seed saved by :func:`rounding_state` (``load_state_dict``): every rounder of ``opt`` draws from
    it from now on.  ``legacy``: the checkpoint holds the generator states of a dml_optim before counter-based
    numbers, which cannot be continued: warned, once, and the current seed kept."""
    if legacy:
        warnings.warn("load_state_dict: this checkpoint holds the stochastic rounding generators of an earlier "
                      "dml_optim ('rounding_generators'); stochastic rounding now draws counter-based numbers from a "
                      f"seed, so the resumed run draws from seed {_seed(opt)} and not the numbers the saved run would "
                      "have drawn", UserWarning, stacklevel=4)
        return
    if saved is None:
        return
    _SEEDS[opt] = saved
    for r in _ROUNDERS.get(opt, {}).values():
        r.seed = saved


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
