"""Loading state dicts into a :class:`~dml_optim.optimizers.base.FlatOptimizer`.

Two layouts load:

* version 1 (ours): torch.optim's layout plus ``{"dml_optim": {"format_version": 1, ...}}``;
  param-group hyperparameters use our names;
* version 0: torch.optim's own layout (no ``dml_optim`` key), e.g. a
  ``torch.optim.Adam`` checkpoint: ``exp_avg``/``exp_avg_sq``/``sum``/
  ``momentum_buffer`` load as our states (the same names), ``lr`` and the
  hyperparameters that mean the same thing are mapped (``betas`` → ``alpha,
  beta`` or ``beta1, beta2``; ``weight_decay`` → ``norm_coefficient``; for
  Adagrad ``lr_decay``/``eps``; for SGD ``momentum``/``dampening``/``nesterov``).
  torch's Adam ``eps`` is *not* mapped: it is added at a different place.

Casting: every state tensor is cast to this optimizer's state dtype and moved
to its device; ``step`` may be a tensor or a number.  Everything is checked
before the first write, so a bad state dict leaves the optimizer untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["load_into"]

_TOP_KEYS = {"state", "param_groups", "dml_optim"}


def _fail(message: str, exc=ValueError):
    raise exc(f"load_state_dict: {message}")


def load_into(opt, state_dict: dict[str, Any]) -> None:
    from dml_optim.optimizers.base import STATE_DICT_FORMAT_VERSION

    if not isinstance(state_dict, dict):
        _fail(f"state_dict must be a dict, got {type(state_dict).__name__}", TypeError)
    missing = {"state", "param_groups"} - state_dict.keys()
    if missing:
        _fail(f"missing keys {sorted(missing)}", KeyError)
    extra = set(state_dict) - _TOP_KEYS
    if extra:
        _fail(f"unexpected keys {sorted(map(str, extra))}", KeyError)
    meta = state_dict.get("dml_optim", {})
    version = meta.get("format_version", 0) if isinstance(meta, dict) else None
    if version not in range(STATE_DICT_FORMAT_VERSION + 1):
        _fail(f"format_version {version!r} is not one this dml_optim reads (0..{STATE_DICT_FORMAT_VERSION})")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        _fail(f"param_groups must be a list, got {type(saved_groups).__name__}", TypeError)
    if len(saved_groups) != len(opt.param_groups):
        _fail(f"the state dict has {len(saved_groups)} parameter groups, this optimizer has {len(opt.param_groups)}")

    # -- param groups: new hyperparameters, checked on copies --------------------
    new_groups = []
    index_of: dict[Any, tuple[int, int]] = {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            _fail(f"param_groups[{gi}] must be a dict with 'params'", TypeError)
        if len(saved["params"]) != len(group["params"]):
            _fail(f"param_groups[{gi}] has {len(saved['params'])} parameters, this optimizer's has {len(group['params'])}")
        for pi, pid in enumerate(saved["params"]):
            index_of[pid] = (gi, pi)
        if version >= 1:
            updates = {k: v for k, v in saved.items() if k != "params"}
            unknown = set(updates) - set(group)
            if unknown:
                _fail(f"param_groups[{gi}] has unknown hyperparameters {sorted(unknown)}", KeyError)
        else:
            updates = dict(opt._from_torch_group(saved))
            updates["lr"] = saved.get("lr", group["lr"])
            for key in ("initial_lr",):
                if key in saved:
                    updates[key] = saved[key]
        candidate = dict(group, **updates)
        try:
            opt._check_hyperparameters(candidate)
            opt._check_options(candidate)
        except (TypeError, ValueError) as exc:
            _fail(f"param_groups[{gi}]: {exc}", type(exc))
        new_groups.append(candidate)

    # -- per-parameter state: checked, converted, then written -----------------
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        _fail(f"state must be a dict, got {type(saved_state).__name__}", TypeError)
    names = set(opt.state_names)
    incoming: dict[tuple[int, int], dict[str, Any]] = {}
    for pid, entry in saved_state.items():
        if pid not in index_of:
            _fail(f"state has an entry for parameter id {pid!r}, which no param group lists", KeyError)
        gi, pi = index_of[pid]
        p = opt.param_groups[gi]["params"][pi]
        where = f"state[{pid!r}] (param_groups[{gi}]['params'][{pi}], shape {tuple(p.shape)})"
        if not isinstance(entry, dict):
            _fail(f"{where} must be a dict, got {type(entry).__name__}", TypeError)
        allowed = names | {"step", "master_param"}
        extra = set(entry) - allowed
        if extra:
            _fail(f"{where} has unexpected keys {sorted(map(str, extra))} (expected {sorted(allowed)})", KeyError)
        missing = (names | {"step"}) - set(entry)
        if missing:
            _fail(f"{where} is missing keys {sorted(missing)}", KeyError)
        step = entry["step"]
        if isinstance(step, torch.Tensor):
            if step.numel() != 1:
                _fail(f"{where}['step'] must be a scalar, got shape {tuple(step.shape)}")
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0 or step != int(step):
            _fail(f"{where}['step'] must be a non-negative whole number, got {entry['step']!r}")
        for key in sorted((names | {"master_param"}) & set(entry)):
            t = entry[key]
            if not isinstance(t, torch.Tensor):
                _fail(f"{where}[{key!r}] must be a tensor, got {type(t).__name__}", TypeError)
            if t.shape != p.shape:
                _fail(f"{where}[{key!r}] has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if not t.dtype.is_floating_point:
                _fail(f"{where}[{key!r}] has dtype {t.dtype}, expected a floating-point tensor", TypeError)
        incoming[(gi, pi)] = dict(entry, step=int(step))

    # -- write -------------------------------------------------------------------
    for gi, (group, candidate) in enumerate(zip(opt.param_groups, new_groups)):
        params = group["params"]
        group.clear()
        group.update(candidate)
        group["params"] = params
        for flat in opt._flats[gi]:
            opt._ensure_state(group, flat)
            for i, pi in enumerate(flat.indices):
                entry = incoming.get((gi, pi))
                flat.steps[i] = entry["step"] if entry else 0
                for name in opt.state_names:
                    view = flat.views(flat.states[name])[i]
                    if entry:
                        view.copy_(entry[name])
                    else:
                        view.zero_()
                if flat.master is not None:
                    view = flat.views(flat.master)[i]
                    view.copy_(entry["master_param"] if entry and "master_param" in entry else flat.params[i].detach())
            if flat.device_steps is not None:
                flat.device_steps.copy_(torch.tensor(flat.steps, dtype=torch.int64))
                flat.step_history = list(flat.steps)
            opt._sync_master(flat)
