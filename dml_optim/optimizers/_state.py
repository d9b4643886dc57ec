"""Loading state dicts into a :class:`~dml_optim.optimizers.base.FlatOptimizer`.

Two layouts load:

* version 1 (ours): torch.optim's layout plus ``{"dml_optim": {"format_version": 1,
  "optimizer": <class name>}}``; param-group hyperparameters use our names;
* version 0: torch.optim's own layout (no ``dml_optim`` key), e.g. a
  ``torch.optim.Adam`` checkpoint: ``exp_avg``/``exp_avg_sq``/``sum``/
  ``momentum_buffer`` load as our states (the same names), ``lr`` and the
  hyperparameters that mean the same thing are mapped (``betas`` → ``alpha,
  beta`` or ``beta1, beta2``; ``weight_decay`` → ``norm_coefficient``; for
  Adagrad ``lr_decay``/``eps``; for SGD ``momentum``/``dampening``/``nesterov``).
  torch's Adam ``eps`` is *not* mapped: it is added at a different place.
  Our own hyperparameter names, when present in such a dict (torch.optim's
  ``Optimizer.state_dict`` over our param groups, e.g. a bare
  ``ZeroRedundancyOptimizer.state_dict()``), are read as they are.
  Flags with no equivalent here are refused when set (``maximize``,
  ``amsgrad``, ``decoupled_weight_decay``), never silently dropped.  A
  ``torch.optim.SGD`` state has no ``step``; a ``momentum_buffer`` means at
  least one step was taken, which is all ONNX Momentum's ``T`` distinguishes,
  so it loads as ``step = 1``.  (torch 2.4's ``AdamW`` writes no flag that
  tells it from ``Adam``: its decoupled ``weight_decay`` would load as our L2
  ``norm_coefficient``; don't load an AdamW checkpoint into ``Adam``.)

Param groups: a version-1 group must hold every hyperparameter of this
optimizer (a missing one is a ``KeyError``); keys that learning-rate
schedulers add (``initial_lr``, ...: ``SCHEDULER_KEYS``) load as they are;
any other unknown key is a ``KeyError``.  Python ints become floats (a huge
int would overflow in the kernels).  Parameter ids must be unique.

Casting: every state tensor is cast to *this* optimizer's state dtype and
moved to its device; the optimizer keeps its own precision and runtime options
(``state_dtype``, ``compute_dtype``, ``master_weights``, ``backend``,
``nonfinite``): the saved ones are checked but not applied.  A
``master_param`` entry loads into an optimizer with master weights and is
ignored by one without (its parameters come from the model's own state dict).
``step`` may be a tensor or a number: a whole number in ``[0, 2**53]`` (for
``DmlAdam``, at most ``2**32 - 1``: its ``T`` is a UINT32).

Atomicity: everything is checked, and every incoming tensor converted into
new buffers, before the first write, so a bad state dict (or a failed
conversion) leaves the optimizer exactly as it was.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["load_into", "MAX_STEP", "SCHEDULER_KEYS"]

_TOP_KEYS = {"state", "param_groups", "dml_optim"}
#: Largest step count accepted (every whole number up to it is exact in float64).
MAX_STEP = 2**53
#: Param-group keys that learning-rate schedulers add; they load as they are.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})
#: torch.optim flags that change the update and have no equivalent here.
_TORCH_FLAGS = ("maximize", "amsgrad", "decoupled_weight_decay")


def _fail(message: str, exc=ValueError):
    raise exc(f"load_state_dict: {message}")


def load_into(opt, state_dict: dict[str, Any]) -> None:
    """Check ``state_dict`` completely, convert it, then write it into ``opt``."""
    version = _check_top(opt, state_dict)
    new_groups, index_of = _check_groups(opt, state_dict["param_groups"], version)
    incoming = _check_state(opt, state_dict["state"], index_of, version)
    staged = _stage(opt, new_groups, incoming)
    _write(opt, new_groups, staged)


# -- checks (nothing is written) ------------------------------------------------


def _check_top(opt, state_dict) -> int:
    from dml_optim.optimizers.base import STATE_DICT_FORMAT_VERSION

    if not isinstance(state_dict, dict):
        _fail(f"state_dict must be a dict, got {type(state_dict).__name__}", TypeError)
    missing = {"state", "param_groups"} - state_dict.keys()
    if missing:
        _fail(f"missing keys {sorted(missing)}", KeyError)
    extra = set(state_dict) - _TOP_KEYS
    if extra:
        _fail(f"unexpected keys {sorted(map(str, extra))}", KeyError)
    if "dml_optim" not in state_dict:
        return 0
    meta = state_dict["dml_optim"]
    if not isinstance(meta, dict):
        _fail(f"'dml_optim' must be a dict with 'format_version', got {meta!r}", TypeError)
    if "format_version" not in meta:
        _fail("'dml_optim' is missing key 'format_version'", KeyError)
    version = meta["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= STATE_DICT_FORMAT_VERSION:
        _fail(f"format_version {version!r} is not one this dml_optim reads (0..{STATE_DICT_FORMAT_VERSION})")
    saved_by = meta.get("optimizer")
    if saved_by is not None:
        if not isinstance(saved_by, str):
            _fail(f"'dml_optim'['optimizer'] must be a class name, got {saved_by!r}", TypeError)
        names = {cls.__name__ for cls in type(opt).__mro__}
        if saved_by not in names:
            _fail(f"the state dict was saved by optimizer {saved_by!r}, this optimizer is {type(opt).__name__!r}")
    return version


def _check_groups(opt, saved_groups, version: int):
    if not isinstance(saved_groups, (list, tuple)):
        _fail(f"param_groups must be a list, got {type(saved_groups).__name__}", TypeError)
    if len(saved_groups) != len(opt.param_groups):
        _fail(f"the state dict has {len(saved_groups)} parameter groups, this optimizer has {len(opt.param_groups)}")
    new_groups = []
    index_of: dict[Any, tuple[int, int]] = {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            _fail(f"param_groups[{gi}] must be a dict with 'params', got {type(saved).__name__}", TypeError)
        ids = saved["params"]
        if not isinstance(ids, (list, tuple)):
            _fail(f"param_groups[{gi}]['params'] must be a list of parameter ids, got {ids!r}", TypeError)
        if len(ids) != len(group["params"]):
            _fail(f"param_groups[{gi}] has {len(ids)} parameters, this optimizer's has {len(group['params'])}")
        for pi, pid in enumerate(ids):
            if isinstance(pid, bool) or not isinstance(pid, (int, str)):
                _fail(f"param_groups[{gi}]['params'][{pi}] must be an int id, got {pid!r}", TypeError)
            if pid in index_of:
                _fail(f"parameter id {pid!r} appears twice in param_groups (param_groups[{gi}]['params'][{pi}])")
            index_of[pid] = (gi, pi)
        updates = _group_updates(opt, group, saved, gi, version)
        candidate = dict(group, **updates)
        for key in opt._options:  # the optimizer keeps its own precision and runtime options
            candidate[key] = group[key]
        for key, value in candidate.items():  # Python ints reach the kernels as floats (2**70 overflows int64)
            if key not in opt._options and isinstance(value, int) and not isinstance(value, bool):
                if abs(value) > 2**1023:
                    _fail(f"param_groups[{gi}]: {key} = {value} is too large for a float")
                candidate[key] = float(value)
        try:
            opt._check_hyperparameters(candidate)
            opt._check_options(candidate)
        except (TypeError, ValueError) as exc:
            _fail(f"param_groups[{gi}]: {exc}", type(exc))
        new_groups.append(candidate)
    return new_groups, index_of


def _group_updates(opt, group, saved: dict, gi: int, version: int) -> dict[str, Any]:
    """The hyperparameters a saved group sets, in our names."""
    if version >= 1:
        updates = {k: v for k, v in saved.items() if k != "params"}
        unknown = set(updates) - set(group) - SCHEDULER_KEYS
        if unknown:
            _fail(f"param_groups[{gi}] has unknown hyperparameters {sorted(map(str, unknown))}", KeyError)
        missing = set(opt.defaults) - set(updates)
        if missing:
            _fail(f"param_groups[{gi}] is missing hyperparameters {sorted(missing)}", KeyError)
        _check_saved_options(updates, gi)
        return updates
    for flag in _TORCH_FLAGS:
        if saved.get(flag):
            _fail(
                f"param_groups[{gi}] has {flag}={saved[flag]!r}, which {type(opt).__name__} does not implement; "
                "refusing to load it with a different update rule"
            )
    try:
        updates = dict(opt._from_torch_group(saved))
    except (TypeError, ValueError) as exc:
        _fail(f"param_groups[{gi}]: cannot read torch.optim hyperparameters: {exc}", type(exc))
    updates["lr"] = saved.get("lr", group["lr"])
    # our own names, when present, win: a dict without the marker written by
    # torch.optim's Optimizer.state_dict over our groups (a bare ZeRO state_dict)
    # holds them, and none of them means something else in torch.optim
    for key in set(opt.defaults) - set(opt._options) - {"lr"}:
        if key in saved:
            updates[key] = saved[key]
    for key in SCHEDULER_KEYS & saved.keys():
        updates[key] = saved[key]
    return updates


def _check_saved_options(updates: dict[str, Any], gi: int) -> None:
    """Saved options must be well formed (they are not applied, see the module docstring)."""
    from dml_optim.optimizers.base import BACKENDS, NONFINITE_MODES, _dtype_arg

    try:
        if "backend" in updates and updates["backend"] not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {updates['backend']!r}")
        if "nonfinite" in updates and updates["nonfinite"] not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {updates['nonfinite']!r}")
        if "master_weights" in updates and not isinstance(updates["master_weights"], bool):
            raise TypeError(f"master_weights must be a bool, got {updates['master_weights']!r}")
        for key in ("state_dtype", "compute_dtype"):
            if key in updates:
                _dtype_arg(key, updates[key])
    except (TypeError, ValueError) as exc:
        _fail(f"param_groups[{gi}]: {exc}", type(exc))


def _check_state(opt, saved_state, index_of, version: int) -> dict[tuple[int, int], dict[str, Any]]:
    if not isinstance(saved_state, dict):
        _fail(f"state must be a dict, got {type(saved_state).__name__}", TypeError)
    names = set(opt.state_names)
    allowed = names | {"step", "master_param"}
    step_optional = version == 0 and opt.state_names == ("momentum_buffer",)  # torch.optim.SGD keeps no step
    max_step = _max_step(opt)
    incoming: dict[tuple[int, int], dict[str, Any]] = {}
    for pid, entry in saved_state.items():
        if not isinstance(pid, (int, str)) or isinstance(pid, bool) or pid not in index_of:
            _fail(f"state has an entry for parameter id {pid!r}, which no param group lists", KeyError)
        gi, pi = index_of[pid]
        p = opt.param_groups[gi]["params"][pi]
        where = f"state[{pid!r}] (param_groups[{gi}]['params'][{pi}], shape {tuple(p.shape)})"
        if not isinstance(entry, dict):
            _fail(f"{where} must be a dict, got {type(entry).__name__}", TypeError)
        extra = set(entry) - allowed
        if extra:
            _fail(f"{where} has unexpected keys {sorted(map(str, extra))} (expected {sorted(allowed)})", KeyError)
        required = names if step_optional else names | {"step"}
        missing = required - set(entry)
        if missing:
            _fail(f"{where} is missing keys {sorted(missing)}", KeyError)
        step = _check_step(entry["step"], where) if "step" in entry else 1
        if step > max_step:
            _fail(f"{where}['step'] = {step} is beyond what {type(opt).__name__} can have reached (max {max_step})")
        for key in sorted((names | {"master_param"}) & set(entry)):
            _check_state_tensor(entry[key], f"{where}[{key!r}]", p)
        incoming[(gi, pi)] = dict(entry, step=step)
    return incoming


def _max_step(opt) -> int:
    """The largest completed-step count ``opt`` can hold (DmlAdam: T = step + 1 is a UINT32)."""
    from dml_optim.optimizers.dml_adam import UINT32_MAX, DmlAdam

    if isinstance(opt, DmlAdam):
        return UINT32_MAX - opt.step_offset + 1
    return MAX_STEP


def _check_step(step, where: str) -> int:
    shown = step
    if isinstance(step, torch.Tensor):
        if step.is_meta:
            _fail(f"{where}['step'] is on the meta device (it holds no value)")
        if step.numel() != 1 or step.layout != torch.strided:
            _fail(f"{where}['step'] must be a scalar, got a tensor of shape {tuple(step.shape)} ({step.layout})")
        if step.dtype.is_complex or step.dtype == torch.bool:
            _fail(f"{where}['step'] must be a real number, got dtype {step.dtype}", TypeError)
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        _fail(f"{where}['step'] must be a non-negative whole number, got {shown!r}", TypeError)
    if isinstance(step, int) and not 0 <= step <= MAX_STEP:
        _fail(f"{where}['step'] must be a non-negative whole number <= 2**53, got {shown!r}")
    if not math.isfinite(step) or step < 0 or step != int(step) or step > MAX_STEP:
        _fail(f"{where}['step'] must be a non-negative whole number <= 2**53, got {shown!r}")
    return int(step)


def _check_state_tensor(t, where: str, p: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{where} must be a tensor, got {type(t).__name__}", TypeError)
    if t.layout != torch.strided:
        _fail(f"{where} must be a dense tensor, got layout {t.layout}", TypeError)
    if t.is_meta:
        _fail(f"{where} is on the meta device (it holds no values)")
    if t.shape != p.shape:
        _fail(f"{where} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
    if not t.dtype.is_floating_point:
        _fail(f"{where} has dtype {t.dtype}, expected a floating-point tensor", TypeError)


# -- staging: conversions into new tensors (nothing of the optimizer is written) -


def _stage(opt, new_groups, incoming) -> list[list[dict[str, Any]]]:
    """Per group and flat buffer: new flat states, master copy and step counts."""
    staged = []
    for gi, candidate in enumerate(new_groups):
        per_flat = []
        for flat in opt._flats[gi]:
            sdtype = opt._state_dtype(candidate, flat)
            states = {name: torch.zeros(flat.numel, dtype=sdtype, device=flat.device) for name in opt.state_names}
            master = flat.data.to(sdtype, copy=True) if candidate["master_weights"] else None
            steps = []
            for i, pi in enumerate(flat.indices):
                entry = incoming.get((gi, pi))
                steps.append(entry["step"] if entry else 0)
                if not entry:
                    continue
                for name in opt.state_names:
                    flat.views(states[name])[i].copy_(entry[name])
                if master is not None and "master_param" in entry:
                    flat.views(master)[i].copy_(entry["master_param"])
            device_steps = None
            if flat.device_steps is not None:
                device_steps = torch.tensor(steps, dtype=torch.int64, device=flat.device)
            per_flat.append(dict(states=states, master=master, steps=steps, device_steps=device_steps))
        staged.append(per_flat)
    return staged


def _write(opt, new_groups, staged) -> None:
    for gi, (group, candidate, per_flat) in enumerate(zip(opt.param_groups, new_groups, staged)):
        params = group["params"]
        group.clear()
        group.update(candidate)
        group["params"] = params
        for flat, new in zip(opt._flats[gi], per_flat):
            opt._ensure_state(group, flat)
            for name in opt.state_names:
                flat.states[name].copy_(new["states"][name])
            if flat.master is not None:
                flat.master.copy_(new["master"])
            flat.steps[:] = new["steps"]
            if flat.device_steps is not None:
                flat.device_steps.copy_(new["device_steps"])
                flat.step_history = list(new["steps"])
            opt._sync_master(flat)
