"""Saving and loading the state dicts of a :class:`~dml_optim.optimizers.base.FlatOptimizer`.

Long by design: one format, written and read side by side (a load checks everything a save wrote before
it writes anything).

:func:`save` writes torch.optim's layout (``state`` by parameter index, each
entry views of the flat buffers; ``param_groups`` with our names and
torch's) plus a ``dml_optim`` marker.  Parameters that are ``DTensor``s
(FSDP2) get ``DTensor`` states with the parameter's sharding, so
``torch.distributed.checkpoint`` saves each rank's shard.

Two layouts load (:func:`load`):

* version 1 (ours): torch.optim's layout plus ``{"dml_optim": {"format_version": 1,
  "optimizer": <class name>}}``; param-group hyperparameters use our names;
* version 0: torch.optim's own layout (no ``dml_optim`` key), e.g. a
  ``torch.optim.Adam`` checkpoint: ``exp_avg``/``exp_avg_sq``/``sum``/
  ``momentum_buffer`` load as our states (the same names), ``lr`` and the
  hyperparameters that mean the same thing are mapped through the class's
  declared torch.optim aliases (``cls.spec.torch``: ``betas`` → ``alpha,
  beta`` or ``beta1, beta2``; ``weight_decay`` → ``norm_coefficient``; for
  Adagrad ``lr_decay``/``eps``; for SGD ``momentum``/``dampening``/``nesterov``;
  AdamW's names are torch's).  torch's Adam ``eps`` is *not* mapped into ONNX
  Adam: it is added at a different place.
  Our own hyperparameter names, when present in such a dict (torch.optim's
  ``Optimizer.state_dict`` over our param groups, e.g. a bare
  ``ZeroRedundancyOptimizer.state_dict()``), are read as they are.
  Flags with no equivalent here are refused when set (``maximize``,
  ``amsgrad``, ``decoupled_weight_decay``, unless they are hyperparameters of
  this class), never silently dropped.  A
  ``torch.optim.SGD`` state has no ``step``; a ``momentum_buffer`` means at
  least one step was taken, which is all ONNX Momentum's ``T`` distinguishes,
  so it loads as ``step = 1``.  (torch 2.4's ``AdamW`` writes no flag that
  tells it from ``Adam``: its decoupled ``weight_decay`` would load as our L2
  ``norm_coefficient``; load AdamW checkpoints into :class:`~dml_optim.AdamW`.)

Param groups: a version-1 group must hold every hyperparameter of this
optimizer under our names (a missing one is a ``KeyError``); torch's names
and the options are optional; keys that learning-rate schedulers add
(``initial_lr``, ...: ``SCHEDULER_KEYS``) load as they are; any other
unknown key is a ``KeyError``.  Python ints become floats (a huge
int would overflow in the kernels).  Parameter ids must be unique.

Casting: every state tensor is cast to *this* optimizer's state dtype and
moved to its device; the optimizer keeps its own precision and runtime options
(``backend``, ``state_dtype``, ``compute_dtype``, ``master_weights``,
``kahan``, ``nonfinite``, ``capturable``): the saved ones are checked but not
applied.  A ``master_param`` (``kahan_comp``) entry loads into an optimizer
with master weights (Kahan summation) and is ignored by one without (its
parameters come from the model's own state dict).  A state entry for a
frozen (unpacked) parameter packs it, as torch.optim keeps such state.
``step`` may be a tensor or a number: a whole number in ``[0, cls.max_step]``
(``2**53``; for ``DmlAdam`` ``2**32 - 1``: its ``T`` is a UINT32).  A DTensor
state entry loads its local shard.

Atomicity: everything is checked, and every incoming tensor converted into
new buffers, before the first write, so a bad state dict (or a failed
conversion) leaves the optimizer exactly as it was.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from dml_optim.core.flat import FlatBuffer, is_distributed, local_tensor, param_piece, store_param_piece
from dml_optim.core import quant
from dml_optim.core.dtypes import master_dtype, precision
from dml_optim.core.quant import BLOCK, CODEBOOKS, QuantizedState, format_for
from dml_optim.core.options import (BACKENDS, MAX_STEP, NONFINITE_MODES, OPTION_NAMES, STATE_DICT_FORMAT_VERSION, check_state_bits,
                               dtype_option)
from dml_optim.optimizers.spec import IMPLEMENTATION_FLAGS, sync_group
from dml_optim.optimizers.rounders import check_rounding_state, load_rounding_state, rounding_state
from dml_optim.optimizers.states import new_state

__all__ = ["save", "load", "marker", "param_state", "SCHEDULER_KEYS", "EXTRA_STATES", "CODES", "ABSMAX"]

_TOP_KEYS = {"state", "param_groups", "dml_optim"}
#: Param-group keys that learning-rate schedulers add; they load as they are.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})
#: Per-parameter entries beside the rule's states: the FP32 master copy and the Kahan compensation.
EXTRA_STATES = ("master_param", "kahan_comp")
#: Suffixes of a quantized state's entries: ``exp_avg_codes`` (uint8) and ``exp_avg_absmax`` (float32, per block).
CODES, ABSMAX = "_codes", "_absmax"


# -- saving -----------------------------------------------------------------------------------


def _as_param_layout(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state view laid out like parameter ``p``: a DTensor with its sharding when ``p`` is one."""
    if not is_distributed(p):
        return view
    cls = type(p)
    return cls.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def param_state(opt, flat: FlatBuffer, i: int, count: int, decoded: bool = False) -> dict[str, Any]:
    """Parameter ``i`` of ``flat``'s state as torch.optim shows it (views of the flat buffers).

    A quantized state is saved as ``<name>_codes`` (uint8: one code, or at 4
    bits two, per byte, over the parameter's whole blocks) and ``<name>_absmax``
    (float32, one scale per block), views of the buffers; ``decoded`` (the
    live ``optimizer.state`` view), or a DTensor parameter (its checkpoint is
    resharded by the parameter's layout), gives the decoded values under
    ``<name>`` instead (a copy).
    """
    if count == 0 or not (flat.states or flat.master is not None or flat.kahan is not None):
        return {}  # (a rule without state, SGD without momentum, saves none, as torch.optim.SGD)
    p = flat.params[i]
    state: dict[str, Any] = {"step": torch.tensor(float(count), dtype=torch.float64)}  # exact to 2**53
    for name, t in flat.states.items():
        piece = param_piece(flat, t, i)
        if not isinstance(piece, QuantizedState):
            state[name] = _as_param_layout(piece, p)
        elif decoded or is_distributed(p):
            state[name] = _as_param_layout(piece.decode(torch.float32)[: flat.sizes[i]].view(flat.shapes[i]), p)
        else:
            state[f"{name}{CODES}"], state[f"{name}{ABSMAX}"] = piece.codes, piece.scales
    for name, t in zip(EXTRA_STATES, (flat.master, flat.kahan)):
        if t is not None:
            state[name] = _as_param_layout(param_piece(flat, t, i), p)
    return state


def save(opt) -> dict[str, Any]:
    """The state dict of ``opt`` (see the module docstring)."""
    opt._follow()
    opt._settle_all()  # a scheduler may have written torch's names since the last step
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for gi, group in enumerate(opt.param_groups):
        where = {}
        for flat in opt._buffers_of(gi):
            counts = flat.counter.counts()  # once per buffer: one sync at most
            for i, pi in enumerate(flat.indices):
                where[pi] = (flat, i, counts[i])
        for pi in range(len(group["params"])):
            if pi in where:
                entry = param_state(opt, *where[pi])
                if entry:
                    state[index + pi] = entry
        packed = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                  for k, v in group.items() if k != "params"}
        stored = {flat.bits for flat in opt._buffers_of(gi) if flat.bits is not None}
        if len(stored) == 1:  # the bits the states are stored in: the group's option may have changed since
            packed["state_bits"] = stored.pop()  # (a step refuses that, and asks for this state dict to be loaded)
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(packed)
    return {"state": state, "param_groups": groups, "dml_optim": marker(opt, state)}


def marker(opt, state: dict) -> dict[str, Any]:
    """The ``dml_optim`` entry of a state dict of ``opt`` whose ``state`` is given (the codebook's name when
    it holds quantized states)."""
    meta: dict[str, Any] = {"format_version": STATE_DICT_FORMAT_VERSION, "optimizer": type(opt).__name__}
    if any(isinstance(k, str) and k.endswith(CODES) for entry in state.values() if isinstance(entry, dict) for k in entry):
        meta["quantization"] = quant.active_codebook()  # (the codebook states are created and loaded in)
    rounding = rounding_state(opt)
    if rounding is not None:  # rounding="stochastic": the seed of its counter-based numbers (a resumed run draws on)
        meta["rounding_seed"] = rounding
    return meta


def _fail(message: str, exc=ValueError):
    raise exc(f"load_state_dict: {message}")


def load(opt, state_dict: dict[str, Any]) -> None:
    """Check ``state_dict`` completely, convert it, then write it into ``opt``."""
    opt._follow()
    version = _check_top(opt, state_dict)
    new_groups, index_of = _check_groups(opt, state_dict["param_groups"], version)
    saved_bits = [g.get("state_bits") if version >= 1 else None for g in state_dict["param_groups"]]
    incoming = _check_state(opt, state_dict["state"], index_of, new_groups, version, saved_bits,
                            state_dict.get("dml_optim", {}).get("quantization"))
    meta = state_dict.get("dml_optim", {})
    rounding = meta.get("rounding_seed")
    why = check_rounding_state(rounding)  # (before anything is written)
    if why is not None:
        _fail(f"'dml_optim'['rounding_seed']: {why}", TypeError)
    opt._include(sorted(incoming))  # frozen parameters with saved state get packed (their values are unchanged)
    staged = _stage(opt, new_groups, incoming)
    _write(opt, new_groups, staged)
    load_rounding_state(opt, rounding, legacy=rounding is None and "rounding_generators" in meta)


# -- checks (nothing is written) ------------------------------------------------


def _check_top(opt, state_dict) -> int:
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
    spec = type(opt).spec
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
        if "param_names" in saved:  # as torch.optim: saved names replace ours; absent, ours stay
            names = saved["param_names"]
            if (not isinstance(names, (list, tuple)) or len(names) != len(ids)
                    or not all(isinstance(n, str) for n in names)):
                _fail(f"param_groups[{gi}]['param_names'] must be a list of {len(ids)} parameter names, got "
                      f"{names!r}")
            candidate["param_names"] = list(names)
        for key in OPTION_NAMES:  # the optimizer keeps its own precision and runtime options
            candidate[key] = group[key]
        for key, value in candidate.items():  # Python ints reach the kernels as floats (2**70 overflows int64)
            if key in spec.names and isinstance(value, int) and not isinstance(value, bool):
                if abs(value) > 2**1023:
                    _fail(f"param_groups[{gi}]: {key} = {value} is too large for a float")
                candidate[key] = float(value)
        try:
            # what changed since the optimizer's last sync is copied to the other name
            synced = sync_group(spec, candidate, opt._layout[gi].synced, f"param_groups[{gi}]")
            opt._check_group(candidate, gi)
        except (TypeError, ValueError, KeyError) as exc:
            _fail(f"{exc}" if str(exc).startswith("param_groups[") else f"param_groups[{gi}]: {exc}", type(exc))
        new_groups.append((candidate, synced))
    return new_groups, index_of


def _group_updates(opt, group, saved: dict, gi: int, version: int) -> dict[str, Any]:
    """The hyperparameters a saved group sets, in our names (and torch's, when it has them)."""
    spec = type(opt).spec
    if version >= 1:
        updates = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        # torch's implementation keys (foreach, fused, ...) differ between torch versions: a key this
        # torch's twin does not have is dropped, not refused
        for key in IMPLEMENTATION_FLAGS:
            if key in updates and key not in group:
                del updates[key]
        unknown = set(updates) - set(group) - SCHEDULER_KEYS
        if unknown:
            _fail(f"param_groups[{gi}] has unknown hyperparameters {sorted(map(str, unknown))}", KeyError)
        missing = set(spec.names) - set(updates)
        if missing:
            _fail(f"param_groups[{gi}] is missing hyperparameters {sorted(missing)}", KeyError)
        _check_saved_options(updates, gi)
        return updates
    for flag in spec.torch.flags:
        if flag not in spec.names and saved.get(flag):
            _fail(f"param_groups[{gi}] has {flag}={saved[flag]!r}, which {type(opt).__name__} does not implement; "
                  "refusing to load it with a different update rule")
    refusal = type(opt).checkpoint_refusal(saved) if type(opt).checkpoint_refusal else None
    if refusal is not None:
        _fail(f"param_groups[{gi}]: {refusal}; refusing to load it with a different update rule")
    try:
        updates = spec.from_torch_group(saved)
    except (TypeError, ValueError) as exc:
        _fail(f"param_groups[{gi}]: cannot read torch.optim hyperparameters: {exc}", type(exc))
    updates.setdefault("lr", group["lr"])
    # our own names, when present, win: a dict without the marker written by
    # torch.optim's Optimizer.state_dict over our groups (a bare ZeRO state_dict)
    # holds them, and none of them means something else in torch.optim
    for key in spec.names:
        if key in saved and key not in spec.torch.same:
            updates[key] = saved[key]
    for key in SCHEDULER_KEYS & saved.keys():
        updates[key] = saved[key]
    return updates


def _check_saved_options(updates: dict[str, Any], gi: int) -> None:
    """Saved options must be well formed (they are not applied, see the module docstring)."""
    try:
        if "backend" in updates and updates["backend"] not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {updates['backend']!r}")
        if "nonfinite" in updates and updates["nonfinite"] not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {updates['nonfinite']!r}")
        for key in ("master_weights", "kahan", "capturable"):
            if key in updates and not isinstance(updates[key], bool):
                raise TypeError(f"{key} must be a bool, got {updates[key]!r}")
        for key in ("state_dtype", "compute_dtype"):
            if key in updates:
                dtype_option(key, updates[key])
        if "state_bits" in updates:
            check_state_bits(updates["state_bits"])
    except (TypeError, ValueError) as exc:
        _fail(f"param_groups[{gi}]: {exc}", type(exc))


def _check_state(opt, saved_state, index_of, new_groups, version: int, saved_bits=(), quantization=None
                 ) -> dict[tuple[int, int], dict[str, Any]]:
    if not isinstance(saved_state, dict):
        _fail(f"state must be a dict, got {type(saved_state).__name__}", TypeError)
    cls = type(opt)
    incoming: dict[tuple[int, int], dict[str, Any]] = {}
    for pid, entry in saved_state.items():
        if not isinstance(pid, (int, str)) or isinstance(pid, bool) or pid not in index_of:
            _fail(f"state has an entry for parameter id {pid!r}, which no param group lists", KeyError)
        gi, pi = index_of[pid]
        if version == 0 and isinstance(entry, dict) and any(v is None for v in entry.values()):
            # a torch checkpoint's None state means "none yet" (torch.optim.SGD before 2.3 saved
            # momentum_buffer=None without momentum, or before a step): torch loads it as a fresh state; so do we
            entry = {k: v for k, v in entry.items() if v is not None}
            if not set(entry) - {"step"}:
                continue
        names = set(cls.group_state_names(new_groups[gi][0]))
        quantized = {f"{n}{suffix}" for n in names for suffix in (CODES, ABSMAX)}
        if isinstance(entry, dict) and quantized & set(entry):
            entry = _quantized_entry(cls, entry, names, saved_bits[gi] if gi < len(saved_bits) else None,
                                     quantization, opt.param_groups[gi]["params"][pi], f"state[{pid!r}]")
        allowed = names | {"step"} | set(EXTRA_STATES)
        step_optional = version == 0 and cls.state_names == ("momentum_buffer",)  # torch.optim.SGD keeps no step
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
        if step > cls.max_step:
            _fail(f"{where}['step'] = {step} is beyond what {cls.__name__} can have reached (max {cls.max_step})")
        for key in sorted((names | set(EXTRA_STATES)) & set(entry)):
            if not isinstance(entry[key], QuantizedState):
                _check_state_tensor(entry[key], f"{where}[{key!r}]", p)
        incoming[(gi, pi)] = dict(entry, step=step)
    return incoming


def _quantized_entry(cls, entry: dict, names: set, bits, quantization, p, where: str) -> dict:
    """``entry`` with each quantized state (``<name>_codes``, ``<name>_absmax``) checked and replaced by a
    :class:`~dml_optim.core.quant.QuantizedState` under ``<name>`` (decoded or copied when staged)."""
    if not isinstance(quantization, str) or quantization not in CODEBOOKS:
        _fail(f"{where} holds quantized states, but the state dict's 'dml_optim' says quantization="
              f"{quantization!r}, not one of {', '.join(map(repr, CODEBOOKS))} (the codebooks this dml_optim reads)")
    if bits not in BLOCK:
        _fail(f"{where} holds quantized states, but its saved param group has state_bits={bits!r}")
    entry = dict(entry)
    n = local_tensor(p).numel()
    block = BLOCK[bits]
    blocks = -(-n // block)
    per_byte = 2 if bits == 4 else 1
    for name in sorted(names):
        codes, absmax = entry.pop(f"{name}{CODES}", None), entry.pop(f"{name}{ABSMAX}", None)
        if codes is None and absmax is None:
            continue
        if codes is None or absmax is None:
            _fail(f"{where} has {name}{CODES if codes is not None else ABSMAX} without "
                  f"{name}{ABSMAX if codes is not None else CODES}", KeyError)
        if name in entry:
            _fail(f"{where} has {name!r} both quantized and in full precision", KeyError)
        for key, t, dtypes, length in ((f"{name}{CODES}", codes, (torch.uint8,), blocks * block // per_byte),
                                       (f"{name}{ABSMAX}", absmax, (torch.float32, torch.float64), blocks)):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
                _fail(f"{where}[{key!r}] must be a dense tensor with values, got {type(t).__name__}", TypeError)
            if t.dtype not in dtypes:
                _fail(f"{where}[{key!r}] has dtype {t.dtype}, expected {dtypes[0]}", TypeError)
            if t.shape != (length,):
                _fail(f"{where}[{key!r}] has shape {tuple(t.shape)}, expected ({length},) for {n} elements at "
                      f"{bits} bits (blocks of {block})")
        negative = int((absmax < 0).sum())  # (a block's maximum magnitude: NaN and inf load, as a full state's do)
        if negative:
            _fail(f"{where}[{name + ABSMAX!r}] holds {negative} negative block maxima of {blocks} (each is a block's "
                  f"largest magnitude, at least 0): the checkpoint is corrupt")
        entry[name] = QuantizedState(codes, absmax.float(),
                                     format_for(bits, signed=name not in cls.unsigned_states, codebook=quantization))
    return entry


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
    if is_distributed(t):
        t, p = local_tensor(t), local_tensor(p)
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
    """Per group and flat buffer: new flat states, master copy, compensation and step counts."""
    staged = []
    for gi, (candidate, _) in enumerate(new_groups):
        per_flat = []
        for flat in opt._buffers_of(gi):
            names = type(opt).group_state_names(candidate)
            states = {name: new_state(type(opt), candidate, flat, name) for name in names}
            master = flat.data.to(master_dtype(candidate, flat.dtype), copy=True) if candidate["master_weights"] else None
            kahan = torch.zeros(flat.numel, dtype=flat.dtype, device=flat.device) if candidate["kahan"] else None
            extras = {"master_param": master, "kahan_comp": kahan}
            steps = []
            for i, pi in enumerate(flat.indices):
                entry = incoming.get((gi, pi))
                steps.append(entry["step"] if entry else 0)
                if not entry:
                    continue
                for name in names:
                    store_param_piece(flat, states[name], i, entry[name])
                for name, t in extras.items():
                    if t is not None and name in entry:
                        store_param_piece(flat, t, i, entry[name])
            per_flat.append(dict(states=states, master=master, kahan=kahan, steps=steps))
        staged.append(per_flat)
    return staged


def _write(opt, new_groups, staged) -> None:
    for gi, (group, (candidate, synced), per_flat) in enumerate(zip(opt.param_groups, new_groups, staged)):
        params = group["params"]
        group.clear()
        group.update(candidate)
        group["params"] = params
        opt._layout[gi].synced = synced
        for flat, new in zip(opt._buffers_of(gi), per_flat):
            flat.states = new["states"]
            flat.master, flat.kahan = new["master"], new["kahan"]
            flat.precision = precision(group)
            flat.scratch = []
            flat.counter.set_counts(new["steps"])
            if flat.master is not None:
                flat.data.copy_(flat.master)
