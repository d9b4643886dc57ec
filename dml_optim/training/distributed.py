"""Helpers for running dml_optim optimizers under ``torch.distributed``.

``DistributedDataParallel`` needs nothing from us (see docs/distributed.md).
``torch.distributed.optim.ZeroRedundancyOptimizer`` needs a helper for each
direction of a checkpoint:

* :func:`zero_state_dict` is ``zero.state_dict()`` (after
  ``zero.consolidate_state_dict(to=rank)``) marked with our
  ``{"dml_optim": {"format_version": 1, ...}}`` key.  ZeRO builds the
  consolidated dict with ``torch.optim.Optimizer.state_dict``, which leaves
  the key out; without it a plain dml_optim optimizer reads the checkpoint as
  a ``torch.optim`` one (format version 0) and takes only ``lr`` from its param
  groups, silently keeping its own constructor's other hyperparameters.
* :func:`load_zero_state_dict` replaces ``zero.load_state_dict``.  ZeRO's
  ``load_state_dict`` restores the local shard by writing each entry straight
  into ``zero.optim.state[param]``, the per-parameter dict every
  ``torch.optim`` optimizer keeps its state in, and never calls
  ``zero.optim.load_state_dict``.  A dml_optim optimizer keeps its state in
  flat buffers, not in that dict, so the loaded moments and step counts would
  be ignored and training would silently restart the optimizer state from
  zero.  The helper loads the shard through the local optimizer's own
  ``load_state_dict`` (validated, cast to its state dtype and device) and then
  lets ZeRO do its own bookkeeping.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.core.options import STATE_DICT_FORMAT_VERSION

__all__ = ["zero_state_dict", "load_zero_state_dict", "local_state_dict"]


def _check_zero(zero) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(f"zero must be a torch.distributed.optim.ZeroRedundancyOptimizer, got {type(zero).__name__}")


def zero_state_dict(zero) -> dict[str, Any]:
    """The consolidated state dict of ``zero``, marked as dml_optim's layout when ``zero.optim`` is ours.

    Call ``zero.consolidate_state_dict(to=r)`` on *every* rank first (a
    collective), then this on rank ``r``.  The result holds every rank's shard
    (state numbered over all parameters, as ``zero.state_dict()``) and loads
    with all its hyperparameters into a plain dml_optim optimizer
    (``opt.load_state_dict``) or, on every rank, into a fresh
    ``ZeroRedundancyOptimizer`` (:func:`load_zero_state_dict`).
    """
    _check_zero(zero)
    state_dict = zero.state_dict()
    if isinstance(zero.optim, FlatOptimizer):
        from dml_optim.optimizers.state_dict import marker

        state_dict["dml_optim"] = marker(zero.optim, state_dict["state"])
    return state_dict


def local_state_dict(zero, state_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard of a consolidated ZeRO ``state_dict``, in the local optimizer's layout.

    ``state_dict`` is what ``zero.state_dict()`` returned on the consolidating
    rank (parameters numbered over all of ZeRO's param groups).  The result
    numbers this rank's parameters the way ``zero.optim.state_dict()`` does.
    A checkpoint of a dml_optim ZeRO (marked by :func:`zero_state_dict`, or
    whose param groups use only the local optimizer's hyperparameter names)
    comes out in our layout with those hyperparameters; any other (e.g. a
    ZeRO over ``torch.optim.Adam``) keeps its param groups as they are and
    loads as a ``torch.optim`` checkpoint (format version 0).
    """
    _check_zero(zero)
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from ZeroRedundancyOptimizer.state_dict())")
    local = zero.optim
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(local.param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} parameter groups, this ZeroRedundancyOptimizer has {len(local.param_groups)}"
        )
    # Ours if marked, or if every saved group uses only our hyperparameter names (an
    # unmarked zero.state_dict() of a dml_optim ZeRO); else a torch.optim layout.
    ours = isinstance(local, FlatOptimizer) and (
        "dml_optim" in state_dict
        or all(set(saved) - {"params"} <= set(group) for group, saved in zip(local.param_groups, saved_groups))
    )
    global_index = {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in zero.param_groups))}
    saved_state = state_dict["state"]
    state: dict[int, Any] = {}
    groups = []
    k = 0
    for group, saved in zip(local.param_groups, saved_groups):
        ids = []
        for p in group["params"]:
            entry = saved_state.get(global_index[id(p)])
            if entry is not None:
                state[k] = entry
            ids.append(k)
            k += 1
        hyper = {name: value for name, value in saved.items() if name != "params" and (name in group or not ours)}
        groups.append(dict(hyper, params=ids))
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    if ours:
        out["dml_optim"] = state_dict.get(
            "dml_optim", {"format_version": STATE_DICT_FORMAT_VERSION, "optimizer": type(local).__name__})
    return out


def load_zero_state_dict(zero, state_dict: dict[str, Any]) -> None:
    """``zero.load_state_dict(state_dict)`` that also works when ``zero.optim`` is a dml_optim optimizer.

    Call it on every rank with the consolidated state dict (from
    ``zero.consolidate_state_dict(to=0)`` on every rank and
    :func:`zero_state_dict` or ``zero.state_dict()`` on rank 0, saved, and
    loaded by each rank).  The local shard is loaded first, through
    ``zero.optim.load_state_dict`` (checked before anything is written), then
    ZeRO's own ``load_state_dict`` runs on a copy of ``state_dict`` (it
    overwrites the entries of other ranks' parameters with ``None``) to
    restore its param groups (its writes to ``zero.optim.state`` land in the
    same flat buffers, with the same values).  For a ``torch.optim`` local
    optimizer this is just ``zero.load_state_dict``.
    """
    _check_zero(zero)
    local = zero.optim
    if isinstance(local, FlatOptimizer):
        local.load_state_dict(local_state_dict(zero, state_dict))
    zero.load_state_dict({"state": dict(state_dict["state"]), "param_groups": state_dict["param_groups"]})
