"""The stateful wrapper shared by every optimizer: flat buffers, one kernel per step.

A subclass names its states, its step-counter offset and how to call its rule
from :mod:`dml_optim.functional`; this class does the rest:

* packs each param group into one :class:`~dml_optim.flat.FlatBuffer` per
  (device, dtype) and keeps parameters and gradients as views of it;
* validates everything a step needs *before* the first in-place write, so a
  step that raises leaves parameters, states and step counters untouched;
* runs the rule once per flat buffer (or once per run of parameters sharing
  a step count, when some parameters had no gradient), with coefficients
  computed on the host from Python numbers: no host sync;
* precision: ``state_dtype``, ``compute_dtype`` and ``master_weights``; when
  the operands' dtypes differ from the compute dtype the rule runs over
  fixed-size chunks converted into preallocated scratch, so extra memory is
  bounded whatever the model size;
* non-finite gradients: ``nonfinite="propagate"`` (like torch.optim),
  ``"skip"`` (detected and skipped on the device: no host sync) or
  ``"raise"`` (one host sync); the skip path is the same gate the loss scaler
  uses (:meth:`FlatOptimizer.step_scaled`, :meth:`FlatOptimizer._plan_updates`);
* a step is planned completely (validation, gradient gathering, coefficients)
  before its commit runs only kernels; ``atomic=True`` also rolls back a
  failure inside the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.optim import Optimizer

from dml_optim.backends import BACKEND_CHOICES
from dml_optim.backends import resolve as resolve_backend
from dml_optim.backends import rule_runner
from dml_optim.flat import FlatBuffer, Run, describe_param, group_key
from dml_optim.functional import check_hyperparameter, check_like
from dml_optim.optimizers._stateview import StateView

__all__ = ["FlatOptimizer", "BACKENDS", "NONFINITE_MODES", "STATE_DICT_FORMAT_VERSION", "CHUNK_ELEMENTS"]

BACKENDS = BACKEND_CHOICES
NONFINITE_MODES = ("propagate", "skip", "raise")
#: Version of the layout ``state_dict()`` writes under ``state_dict()["dml_optim"]``.
#: Version 0 is torch.optim's layout (no ``dml_optim`` key), which still loads.
STATE_DICT_FORMAT_VERSION = 1
#: Elements per chunk when the rule runs in a wider compute dtype than storage.
CHUNK_ELEMENTS = 1 << 20

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Update:
    """One planned rule application: a run of one buffer and its coefficients."""

    group: dict
    flat: FlatBuffer
    run: Run
    scalars: dict
    finite: torch.Tensor | None


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _device_constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-d tensor holding ``value`` (read-only by convention)."""
    key = (float(value), dtype, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.full((), float(value), dtype=dtype, device=device)
    return t


def _dtype_arg(name: str, value) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = getattr(torch, value, value)
    if not isinstance(value, torch.dtype) or value not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be one of float16, bfloat16, float32, float64 or None, got {value!r}")
    return value


class FlatOptimizer(Optimizer):
    """Base class: subclasses set the class attributes and :meth:`_rule`."""

    #: Names of the per-parameter state tensors (torch.optim's names).
    state_names: tuple[str, ...] = ()
    #: T passed to the rule = completed steps + step_offset.
    step_offset: int = 0
    #: Coefficients that make a step an exact no-op when gated (skip on overflow).
    skip_identity: dict[str, float] = {}
    #: dml_optim's own options stored in each param group (not hyperparameters).
    _options = ("backend", "state_dtype", "compute_dtype", "master_weights", "nonfinite")

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        *,
        backend: str = "auto",
        state_dtype=None,
        compute_dtype=None,
        master_weights: bool = False,
        nonfinite: str = "propagate",
        atomic: bool = False,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {nonfinite!r}")
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {master_weights!r}")
        if not isinstance(atomic, bool):
            raise TypeError(f"atomic must be a bool, got {atomic!r}")
        #: Roll a step back if a kernel fails mid-update (costs one copy of
        #: parameters and states per step).
        self.atomic = atomic
        self._check_hyperparameters(defaults)
        defaults = dict(
            defaults,
            backend=backend,
            state_dtype=_dtype_arg("state_dtype", state_dtype),
            compute_dtype=_dtype_arg("compute_dtype", compute_dtype),
            master_weights=master_weights,
            nonfinite=nonfinite,
        )
        self._flats: list[list[FlatBuffer]] = []
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of Tensors or dicts, got a Tensor")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"params must be given as an ordered collection (a list), got a {type(params).__name__}")
        super().__init__(params, defaults)
        self.state = StateView(self)

    # -- subclass hooks ------------------------------------------------------

    #: ``{name: check_hyperparameter keyword ranges}`` of the subclass's hyperparameters.
    hyperparameter_ranges: dict[str, dict[str, Any]] = {}

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Check every hyperparameter of ``group`` and store it back as a float
        (a huge int or a 0-d tensor must not reach the kernels)."""
        for name, ranges in self.hyperparameter_ranges.items():
            group[name] = check_hyperparameter(name, group[name], **ranges)

    def _coefficients(self, group: dict[str, Any], T) -> dict[str, Any]:  # pragma: no cover - abstract
        """Per-step scalars of the rule at step ``T`` (number or 0-d tensor)."""
        raise NotImplementedError

    def _rule(self, x, g, states: Sequence[torch.Tensor], scalars: dict[str, Any], scratch) -> None:  # pragma: no cover
        """Apply the rule in place (``functional.*_``)."""
        raise NotImplementedError

    def _scratch_count(self, group: dict[str, Any], gated: bool) -> int:
        """Full-size scratch tensors the rule needs (``gated``: coefficients are tensors)."""
        return 1

    # -- construction ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters are packed into flat buffers at once."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError(f"params must be given as an ordered collection (a list), got a {type(params).__name__}")
        else:
            params = list(params) if params is not None else []
        group["params"] = params
        group_index = len(self.param_groups)
        for i, p in enumerate(params):
            self._check_param(p, i, group_index)
        for name, value in self.defaults.items():
            group.setdefault(name, value)
        self._check_hyperparameters(group)
        self._check_options(group)
        first_index: dict[int, int] = {}
        for i, p in enumerate(params):
            if id(p) in first_index:
                raise ValueError(
                    f"params: param_groups[{group_index}] lists the same parameter twice "
                    f"(['params'][{first_index[id(p)]}] and ['params'][{i}])"
                )
            first_index[id(p)] = i
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"params: {describe_param(p, i, group_index)} appears in more than one parameter group")
        devices = {str(p.device) for p in params}
        if len(devices) > 1:
            raise ValueError(f"params: param_groups[{group_index}] mixes devices {sorted(devices)}; use one group per device")
        super().add_param_group(group)
        self._flats.append(self._pack(group))

    def _check_param(self, p, index: int, group_index: int) -> None:
        where = f"params: param_groups[{group_index}]['params'][{index}]"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where} must be a Tensor, got {type(p).__name__}")
        if p.is_complex():
            raise TypeError(
                f"{where} is complex ({p.dtype}); dml_optim refuses complex parameters: "
                "pass torch.view_as_real(p) parameters instead"
            )
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{where} must be floating point, got dtype {p.dtype}")
        if not p.is_leaf:
            raise ValueError(f"{where} is not a leaf tensor; optimize leaf tensors (nn.Parameter or detach().requires_grad_())")
        if p.is_sparse:
            raise TypeError(f"{where} is sparse; dml_optim supports dense parameters only")

    def _check_options(self, group: dict[str, Any]) -> None:
        if group["backend"] not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {group['backend']!r}")
        if group["nonfinite"] not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {group['nonfinite']!r}")
        for key in ("state_dtype", "compute_dtype"):
            group[key] = _dtype_arg(key, group[key])
        if not isinstance(group["master_weights"], bool):
            raise TypeError(f"master_weights must be a bool, got {group['master_weights']!r}")
        if group["master_weights"]:
            for p in group["params"]:
                if p.dtype not in (torch.float16, torch.bfloat16):
                    raise ValueError(f"master_weights=True needs float16 or bfloat16 parameters, got {p.dtype}")

    def _pack(self, group: dict[str, Any]) -> list[FlatBuffer]:
        by_key: dict[tuple, list[int]] = {}
        for i, p in enumerate(group["params"]):
            by_key.setdefault(group_key(p), []).append(i)
        flats = []
        for indices in by_key.values():
            flat = FlatBuffer([group["params"][i] for i in indices], indices)
            flat.steps = [0] * len(flat)
            flat.device_steps = None
            flat.scratch = []
            flat.master = None
            flats.append(flat)
        return flats

    # -- precision ------------------------------------------------------------

    @staticmethod
    def _precision(group) -> tuple:
        return (group["state_dtype"], group["compute_dtype"], group["master_weights"])

    def _state_dtype(self, group, flat: FlatBuffer) -> torch.dtype:
        if group["master_weights"]:
            return group["state_dtype"] or torch.float32
        return group["state_dtype"] or flat.dtype

    def _compute_dtype(self, group, flat: FlatBuffer) -> torch.dtype:
        if group["compute_dtype"] is not None:
            return group["compute_dtype"]
        return self._state_dtype(group, flat) if group["master_weights"] else flat.dtype

    def _ensure_state(self, group, flat: FlatBuffer) -> None:
        """Allocate flat states, master copy and scratch (first step, or after a load)."""
        if flat.states:
            if len(flat.scratch) != self._scratch_total(group, flat):
                self._alloc_scratch(group, flat)
            return
        flat.precision = self._precision(group)
        sdtype = self._state_dtype(group, flat)
        for name in self.state_names:
            flat.states[name] = torch.zeros(flat.numel, dtype=sdtype, device=flat.device)
        if group["master_weights"]:
            flat.master = flat.data.to(sdtype)
        self._alloc_scratch(group, flat)

    def _operand_dtypes(self, group, flat: FlatBuffer) -> list[torch.dtype]:
        x = flat.master if flat.master is not None else flat.data
        return [x.dtype, flat.grad.dtype] + [s.dtype for s in flat.states.values()]

    def _chunked(self, group, flat: FlatBuffer) -> bool:
        cdtype = self._compute_dtype(group, flat)
        return any(d != cdtype for d in self._operand_dtypes(group, flat))

    def _scratch_total(self, group, flat: FlatBuffer) -> int:
        n = self._scratch_count(group, gated=flat.device_steps is not None)
        return n + 2 + len(self.state_names) if self._chunked(group, flat) else n

    def _alloc_scratch(self, group, flat: FlatBuffer, full: bool = False) -> None:
        """Scratch for the rule (and, in chunked mode, for the converted operands).

        Full-size for the eager op chain; one chunk when the rule runs chunked,
        or compiled (the fused kernel needs none: the chunk only serves the
        non-finite check).  ``full`` forces full size (compilation fell back).
        """
        compact = self._chunked(group, flat) or (
            not full and resolve_backend(group["backend"], flat.device, flat.numel) == "compiled"
        )
        size = min(flat.numel, CHUNK_ELEMENTS) if compact else flat.numel
        cdtype = self._compute_dtype(group, flat)
        flat.scratch = [torch.empty(size, dtype=cdtype, device=flat.device) for _ in range(self._scratch_total(group, flat))]

    # -- stepping -------------------------------------------------------------

    #: torch.amp.GradScaler hands itself to ``step(grad_scaler=...)`` instead of
    #: unscaling with its CPU-fallback helpers (see :mod:`dml_optim.amp`).
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler=None):
        """Perform one optimization step; ``closure`` re-evaluates the loss.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step`` (this class
        sets ``_step_supports_amp_scaling``): the unscale, the non-finite check
        and the skip then run on the device (see :mod:`dml_optim.amp`).
        """
        if grad_scaler is not None:
            from dml_optim.amp import step_with_grad_scaler

            return step_with_grad_scaler(self, grad_scaler, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._prepare()
        self._raise_if_nonfinite([flat for group, flat, _ in work if group["nonfinite"] == "raise"])
        # one flag for every "skip" buffer: a step is skipped as a whole
        finite = self._all_finite([flat for group, flat, _ in work if group["nonfinite"] == "skip"])
        updates = [
            u
            for group, flat, has_grad in work
            for u in self._plan_updates(group, flat, has_grad, finite.to(flat.device) if group["nonfinite"] == "skip" else None)
        ]
        self._commit(work, updates)
        return loss

    @torch.no_grad()
    def step_scaled(self, inv_scale: torch.Tensor, found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """A loss-scaled step with no host sync; returns ``found_inf`` (0-d float32).

        Gradients are multiplied by ``inv_scale`` (a 0-d device tensor; pass
        ones if they are already unscaled), checked for inf/NaN on the device,
        and the update of *every* buffer is gated by that one flag: on
        overflow, parameters, states and step counters stay exactly as they
        were.  If ``found_inf`` is given (already known), it is used as is.
        """
        work = self._prepare()
        if not work:
            return torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        if found_inf is None:
            finite = self._unscale(work, inv_scale)
        else:
            for _, flat, _ in work:
                flat.grad.mul_(inv_scale.to(flat.device))
            finite = found_inf == 0
        updates = [u for group, flat, has_grad in work for u in self._plan_updates(group, flat, has_grad, finite.to(flat.device))]
        self._commit(work, updates)
        return finite.logical_not().float()

    @torch.no_grad()
    def unscale_(self, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale``; return ``found_inf`` (0-d float32).

        For gradient clipping between unscaling and stepping: afterwards call
        ``step_scaled(ones, found_inf=found_inf)``.  No host sync; parameters
        and states are not touched.
        """
        work = self._prepare()
        if not work:
            return torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        return self._unscale(work, inv_scale).logical_not().float()

    def _unscale(self, work, inv_scale: torch.Tensor) -> torch.Tensor:
        """Unscale the gradients of ``work``; 0-d bool: all of them are finite."""
        for _, flat, _ in work:
            flat.grad.mul_(inv_scale.to(flat.device))
        return self._all_finite([flat for _, flat, _ in work])

    def _prepare(self) -> list[tuple[dict, FlatBuffer, list[bool]]]:
        """Validate every group, then gather gradients and allocate states.

        Raises before any parameter or state is written.  Returns the buffers
        that have at least one gradient, with their per-parameter flags.
        """
        plans = [self._plan(gi, group) for gi, group in enumerate(self.param_groups)]
        work = []
        for group, flats, plan in zip(self.param_groups, self._flats, plans):
            for flat, (has_grad, foreign, moved) in zip(flats, plan):
                if not any(has_grad):
                    continue
                if moved:
                    flat.adopt_params(moved)
                if foreign:
                    flat.gather_grads(foreign)
                if not all(has_grad):  # slots of None grads may hold an old gradient (inf included)
                    for active, run in flat.runs(has_grad):
                        if not active:
                            flat.grad[run.start : run.end].zero_()
                self._ensure_state(group, flat)
                work.append((group, flat, has_grad))
        return work

    def _plan(self, group_index: int, group: dict[str, Any]):
        """Validate a group's step without writing anything."""
        self._check_hyperparameters(group)
        self._check_options(group)
        plan = []
        for flat in self._flats[group_index]:
            if flat.states and flat.precision != self._precision(group):
                old, new = flat.precision, self._precision(group)
                changed = [f"{k} from {a} to {b}" for k, a, b in zip(("state_dtype", "compute_dtype", "master_weights"), old, new) if a != b]
                raise ValueError(
                    f"param_groups[{group_index}]: {', '.join(changed)} after the states were allocated is not "
                    "supported; build a new optimizer with the new options and load_state_dict() into it"
                )
            has_grad, foreign = flat.grad_status()
            for i in foreign:
                self._check_grad(flat, i, group_index)
            moved = flat.params_moved()
            for i in moved:
                p = flat.params[i]
                if p.dtype != flat.dtype or p.device != flat.device or p.shape != flat.grad_views[i].shape:
                    raise RuntimeError(
                        f"{describe_param(p, flat.indices[i], group_index)} was re-bound to a tensor of another "
                        f"dtype, device or shape after the optimizer was created (it was {flat.dtype} on {flat.device}); "
                        "create the optimizer after moving the model"
                    )
            plan.append((has_grad, foreign, moved))
        return plan

    def _check_grad(self, flat: FlatBuffer, i: int, group_index: int) -> None:
        p, grad = flat.params[i], flat.params[i].grad
        where = describe_param(p, flat.indices[i], group_index)
        if grad.is_sparse:
            raise TypeError(f"grad of {where} is sparse; dml_optim supports dense gradients only")
        check_like(f"grad of {where}", grad, "the parameter", p)

    def _runs(self, flat: FlatBuffer, has_grad: list[bool], steps: list) -> list[tuple[Any, Run]]:
        if all(has_grad) and all(s == steps[0] for s in steps):
            return [((True, steps[0]), Run(0, len(flat), 0, flat.numel))]
        return flat.runs(list(zip(has_grad, steps)))

    def _scalars(self, group, T) -> dict[str, Any]:
        return {**self._constants(group), **self._coefficients(group, T)}

    def _constants(self, group) -> dict[str, Any]:
        """Group constants passed to the rule (hyperparameters other than lr)."""
        return {}

    # -- gated (skip-on-overflow) steps: device-side counters, no host sync ----

    def _finite(self, flat: FlatBuffer) -> torch.Tensor:
        """0-d bool on the device: every gradient element is finite (no host sync).

        ``amax(|g|) < inf`` is false for an inf and for a NaN (amax propagates
        NaN); abs, amax and lt are DirectML-native.
        """
        if flat.numel == 0:
            return _device_constant(1.0, torch.float32, flat.device) > 0
        scratch = flat.scratch[0]
        finite = None
        for a in range(0, flat.numel, len(scratch)):
            b = min(a + len(scratch), flat.numel)
            s = scratch[: b - a]
            if s.dtype == flat.grad.dtype:
                torch.abs(flat.grad[a:b], out=s)
            else:
                s.copy_(flat.grad[a:b]).abs_()
            ok = torch.amax(s) < math.inf
            finite = ok if finite is None else finite.logical_and_(ok)
        return finite

    def _all_finite(self, flats: list[FlatBuffer]) -> torch.Tensor | None:
        """0-d bool on the first buffer's device: every gradient of ``flats`` is finite
        (None for no buffers).  No host sync."""
        finite = None
        for flat in flats:
            ok = self._finite(flat)
            finite = ok if finite is None else finite.logical_and_(ok.to(finite.device))
        return finite

    # -- plan, then commit: nothing is written before every update is planned --

    def _plan_updates(self, group, flat: FlatBuffer, has_grad: list[bool], finite: torch.Tensor | None) -> list[_Update]:
        """The updates of one buffer with their coefficients; writes nothing.

        Without a gate, coefficients are Python numbers computed from the host
        step counters (no device op, no host sync).  With a gate (``finite``,
        a 0-d bool on the device), or once a buffer has had one, the counters
        live on the device and the coefficients are 0-d tensors: when
        ``finite`` is false the gradient is zeroed and every coefficient named
        in ``skip_identity`` takes its identity value, so parameters, states
        and counters stay bit-exactly as they were.  The host then only tracks
        which parameters stepped together, so it can still form runs of
        parameters that share a counter.
        """
        if finite is None and flat.device_steps is None:
            updates = [
                _Update(group, flat, run, self._scalars(group, T + self.step_offset), None)
                for (active, T), run in self._runs(flat, has_grad, flat.steps)
                if active
            ]
            self._check_range(group, flat, {name: group[name] for name in self.hyperparameter_ranges})
            for u in updates:
                self._check_range(group, flat, u.scalars)
            return updates
        if flat.device_steps is None:  # the same counts, moved to the device
            flat.device_steps = torch.tensor(flat.steps, dtype=torch.int64, device=flat.device)
            flat.step_history = list(flat.steps)
            flat.history_ids = {}
            flat.gated_calls = 0
        if len(flat.scratch) != self._scratch_total(group, flat):
            self._alloc_scratch(group, flat)
        coef_dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        updates = []
        for (active, _), run in self._runs(flat, has_grad, flat.step_history):
            if not active:
                continue
            T = flat.device_steps[run.first].to(coef_dtype) + self.step_offset
            scalars = self._scalars(group, T)
            if finite is not None:
                scalars = self._gate(scalars, finite, coef_dtype)
            updates.append(_Update(group, flat, run, scalars, finite))
        return updates

    def _check_range(self, group, flat: FlatBuffer, scalars: dict[str, Any]) -> None:
        """Refuse per-step scalars the compute dtype cannot hold (before any write)."""
        limit = torch.finfo(self._compute_dtype(group, flat)).max
        for name, value in scalars.items():
            if isinstance(value, float) and abs(value) > limit:
                raise ValueError(
                    f"{name}={value!r} (from the hyperparameters of this param group) is beyond the range of "
                    f"{self._compute_dtype(group, flat)} (max {limit:g}); nothing was updated"
                )

    def _commit(self, work, updates: list[_Update]) -> None:
        """Run the planned updates; then advance the host-side bookkeeping.

        Only kernels run here.  If one raises (a device fault, an interrupt,
        an injected failure), an optimizer built with ``atomic=True`` restores
        parameters, states and counters from a snapshot taken before the first
        write; otherwise the exception gets a note naming what may have been
        partially updated.
        """
        snapshot = self._snapshot(work) if self.atomic else None
        done: list[_Update] = []
        try:
            zeroed = set()
            for u in updates:
                if u.finite is not None and id(u.flat) not in zeroed:
                    u.flat.grad.masked_fill_(u.finite.logical_not(), 0)
                    zeroed.add(id(u.flat))
                self._apply(u.group, u.flat, u.run, u.scalars)
                if u.flat.device_steps is not None:
                    u.flat.device_steps[u.run.first : u.run.stop].add_(u.finite.long() if u.finite is not None else 1)
                done.append(u)
            for _, flat, _ in work:
                self._sync_master(flat)
        except BaseException as exc:
            if snapshot is not None:
                for dst, src in snapshot:
                    dst.copy_(src)
            elif hasattr(exc, "add_note"):
                exc.add_note(
                    f"dml_optim: {type(self).__name__}.step() failed while writing (after {len(done)} of "
                    f"{len(updates)} parameter runs had finished); parameters and states may be partially "
                    "updated. Restore a checkpoint, or construct the optimizer with atomic=True to roll "
                    "failed steps back."
                )
            raise
        for u in updates:  # host bookkeeping, after every kernel succeeded
            if u.flat.device_steps is None:
                for i in range(u.run.first, u.run.stop):
                    u.flat.steps[i] += 1
        for _, flat, has_grad in work:
            if flat.device_steps is not None:
                for i, active in enumerate(has_grad):
                    if active:
                        key = (flat.step_history[i], flat.gated_calls)
                        flat.step_history[i] = flat.history_ids.setdefault(key, ("h", len(flat.history_ids)))
                flat.gated_calls += 1

    def _snapshot(self, work) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of everything a commit writes (``atomic=True`` only)."""
        tensors = []
        for _, flat, _ in work:
            tensors += [flat.data, flat.grad, *flat.states.values()]
            if flat.master is not None:
                tensors.append(flat.master)
            if flat.device_steps is not None:
                tensors.append(flat.device_steps)
        return [(t, t.clone()) for t in tensors]

    def _gate(self, scalars: dict[str, Any], finite: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
        """Replace each coefficient of ``skip_identity`` by ``where(finite, value, identity)``.

        Number operands become cached 0-d device tensors (made once with a
        device fill), so a gated step copies nothing from the host.
        """
        gated = dict(scalars)
        for name, identity in self.skip_identity.items():
            if name in gated:
                value = gated[name]
                if not isinstance(value, torch.Tensor) and value == identity:
                    continue  # already a no-op: stays a number (fewer ops, no scratch needed)
                if not isinstance(value, torch.Tensor):
                    value = _device_constant(value, dtype, finite.device)
                gated[name] = torch.where(finite, value, _device_constant(identity, dtype, finite.device))
        return gated

    def _raise_if_nonfinite(self, flats: list[FlatBuffer]) -> None:
        """``nonfinite="raise"``: one host sync per step; names the offending parameters."""
        finite = self._all_finite(flats)
        if finite is None or bool(finite):
            return
        bad = []
        for gi, group_flats in enumerate(self._flats):
            for flat in group_flats:
                if flat in flats:
                    bad += [describe_param(p, idx, gi) for p, idx, g in zip(flat.params, flat.indices, flat.grad_views)
                            if p.grad is not None and not bool(torch.isfinite(g).all())]
        raise FloatingPointError(f"non-finite gradient (inf or nan) in {', '.join(bad)}; nothing was updated")

    # -- applying the rule ----------------------------------------------------

    def _apply(self, group, flat: FlatBuffer, run: Run, scalars: dict[str, Any]) -> None:
        """Run the rule over ``run`` of the buffer, chunked when dtypes differ."""
        rule = rule_runner(self, group, flat)
        x = flat.master if flat.master is not None else flat.data
        names = self.state_names
        operands = [x, flat.grad] + [flat.states[n] for n in names]
        if not self._chunked(group, flat):
            if getattr(rule, "uses_scratch", True) and flat.scratch and len(flat.scratch[0]) < flat.numel:
                self._alloc_scratch(group, flat, full=True)  # compiled fell back to eager: once
            if run.start == 0 and run.end == flat.numel:  # the common case: no view ops at all
                rule(x, flat.grad, [flat.states[n] for n in names], scalars, flat.scratch)
                return
            sl = slice(run.start, run.end)
            scratch = [s[sl] for s in flat.scratch]
            rule(x[sl], flat.grad[sl], [flat.states[n][sl] for n in names], scalars, scratch)
            return
        if run.start == run.end:
            return
        n_rule = len(flat.scratch) - len(operands)
        chunk = len(flat.scratch[0])
        conv = flat.scratch[n_rule:]
        for a in range(run.start, run.end, chunk):
            b = min(a + chunk, run.end)
            k = b - a
            local = [c[:k].copy_(t[a:b]) for c, t in zip(conv, operands)]
            rule(local[0], local[1], local[2:], scalars, [s[:k] for s in flat.scratch[:n_rule]])
            for t, c in zip(operands, local):
                if t is not flat.grad:
                    t[a:b].copy_(c)

    def _sync_master(self, flat: FlatBuffer) -> None:
        if flat.master is not None:
            flat.data.copy_(flat.master)

    # -- zero_grad -------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient with one op per flat buffer.

        Unlike torch.optim (whose default is ``set_to_none=True``), the default
        keeps each ``p.grad`` a view of the flat gradient buffer, so autograd
        accumulates in place and nothing is allocated per step.  As in
        torch.optim, a ``None`` gradient stays ``None``.  With
        ``set_to_none=True`` gradients become ``None`` (and a parameter that
        gets no gradient before the next step is not updated); the next step
        gathers the new gradients into the flat buffer (one copy each).
        """
        for flats in self._flats:
            for flat in flats:
                flat.zero_grad(set_to_none)

    # -- state dict ------------------------------------------------------------

    @staticmethod
    def _step_counts(flat: FlatBuffer) -> list[int]:
        """Completed steps per parameter (a host sync when the counters are on the device)."""
        return flat.device_steps.tolist() if flat.device_steps is not None else flat.steps

    def _param_state(self, group, flat: FlatBuffer, i: int, steps: list[int] | None = None) -> dict[str, Any]:
        """Parameter ``i``'s state as torch.optim shows it (views of the flat buffers)."""
        if not flat.states:
            return {}
        steps = self._step_counts(flat) if steps is None else steps
        if steps[i] == 0:
            return {}
        state: dict[str, Any] = {"step": torch.tensor(float(steps[i]), dtype=torch.float64)}  # exact to 2**53
        for name in self.state_names:
            state[name] = flat.views(flat.states[name])[i]
        if flat.master is not None:
            state["master_param"] = flat.views(flat.master)[i]
        return state

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (``state`` by parameter index, ``param_groups``),
        plus ``dml_optim: {"format_version": 1, "optimizer": <class name>}``.

        Contains only tensors and plain Python values, so
        ``torch.load(..., weights_only=True)`` loads it.  State tensors are
        views of the flat buffers (torch.save stores each buffer once).
        """
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, flats in zip(self.param_groups, self._flats):
            where = {}
            for flat in flats:
                steps = self._step_counts(flat)  # once per buffer: one sync at most
                for i, gi in enumerate(flat.indices):
                    where[gi] = (flat, i, steps)
            ids = []
            for gi in range(len(group["params"])):
                flat, i, steps = where[gi]
                s = self._param_state(group, flat, i, steps)
                if s:
                    state[index] = s
                ids.append(index)
                index += 1
            packed = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in group.items() if k != "params"}
            packed["params"] = ids
            groups.append(packed)
        return {
            "state": state,
            "param_groups": groups,
            "dml_optim": {"format_version": STATE_DICT_FORMAT_VERSION, "optimizer": type(self).__name__},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of the torch.optim equivalent.

        Everything is checked before anything is written.  State tensors are
        cast to this optimizer's state dtype and device (a checkpoint saved on
        CUDA in float32 loads into a DirectML float16 optimizer and back).
        """
        from dml_optim.optimizers._state import load_into

        load_into(self, state_dict)
