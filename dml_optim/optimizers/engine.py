"""Running a flat optimizer's rule over its buffers: planning, committing, precision.

:class:`EngineMixin` (a part of :class:`~dml_optim.optimizers.base.FlatOptimizer`)
takes the buffers :mod:`~dml_optim.optimizers.layout` prepared and runs the
update:

* **plan** (:meth:`EngineMixin._run`): for each class of parameters that
  step together, the step limit is checked and, when the host knows the
  count and the step is not gated, the rule's scalars are computed on the
  host as Python numbers (range-checked against the compute dtype): no
  device op, no sync;
* **commit** (:meth:`EngineMixin._commit`): only kernels run: the compiled
  kernel (one per class) or the eager rule, with counts on the host or on the
  device (gated steps, ``capturable``); ``atomic=True`` snapshots first and
  rolls back a failure; then the host bookkeeping (step classes) advances;
* **precision** (``state_dtype``, ``compute_dtype``, ``master_weights``,
  ``kahan``): the dtype rules, and the eager rule run over bounded chunks
  through preallocated scratch when operands are converted
  (:func:`dml_optim.core.update.run_rule`);
* **non-finite gradients**: one device-side reduction per buffer
  (``nonfinite="skip"`` gates the step on it; ``"raise"`` reads it: one sync).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dml_optim.backends.choose import compiles, fuses, masked_runner, runner_for, tiers
from dml_optim.backends.compiled import _dispatch_mode_active
from dml_optim.core.flat import _GRAD, FlatBuffer, describe_param
from dml_optim.backends.fused import kernel_scalars, reads_in_place, remember_read
from dml_optim.backends.fused import plan as plan_fused
from dml_optim.backends.fused import run as run_fused
from dml_optim.optimizers.layout import _unchanged
from dml_optim.core.steps import StepClass
from dml_optim.core.options import CHUNK_ELEMENTS, LOW_PRECISION_DTYPES
from dml_optim.core.quant import QuantizedState, format_for
from dml_optim.core.update import (coefficient_dtype, conversion_count, masked_scalars, masked_step, run_rule, step_scalars,
                              storage_dtype)

__all__ = ["EngineMixin", "MASKED_DEVICES"]

#: Devices where parameters at several step counts take one masked update (:meth:`EngineMixin._masks`).
#: Not the CPU: there one update per run of parameters at one count, in the buffer's order, is faster
#: (2 cores, 40 x 16k parameters with changing None patterns, AdamW: per-element gathers made the masked
#: kernel 5.7 ms a step; 4.2M elements at two counts: 3.5 ms masked, 1.7 ms as two eager updates).
MASKED_DEVICES = ("privateuseone", "cuda")

#: The class slot of a planned update that runs torch's fused kernel (:mod:`dml_optim.backends.fused`).
FUSED = "fused"


#: How many counts a fused buffer's range check covers at once (:meth:`EngineMixin._counts_in_range`).
_AHEAD = 256

#: The largest finite value of each compute dtype (``torch.finfo`` is not free on every step).
_LIMITS: dict[torch.dtype, float] = {}


class EngineMixin:
    """The running half of a flat optimizer (see the module docstring)."""

    @staticmethod
    def _precision(group) -> tuple:
        return (group["state_dtype"], group["compute_dtype"], group["master_weights"], group["kahan"],
                group["state_bits"])

    @classmethod
    def _master_dtype(cls, group, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the master copy (``master_weights=True``): the compute dtype, at least FP32."""
        cdtype = cls._compute_dtype(group, dtype)
        return torch.float32 if cdtype in LOW_PRECISION_DTYPES else cdtype

    @staticmethod
    def _state_dtype(group, dtype: torch.dtype) -> torch.dtype:
        """States are FP32 with master weights or Kahan unless ``state_dtype`` says otherwise."""
        if group["state_dtype"] is not None:
            return group["state_dtype"]
        return torch.float32 if group["master_weights"] or group["kahan"] else dtype

    @classmethod
    def _compute_dtype(cls, group, dtype: torch.dtype, bits: int | None = None) -> torch.dtype:
        """Arithmetic dtype: ``compute_dtype``, else FP32 (at least) with master weights, Kahan or quantized
        states (``bits``: the buffer's), else the parameters'."""
        if group["compute_dtype"] is not None:
            return group["compute_dtype"]
        if group["master_weights"] or group["kahan"]:
            sdtype = cls._state_dtype(group, dtype) if not bits else torch.float32
            return torch.float32 if sdtype in LOW_PRECISION_DTYPES else sdtype
        if bits:
            return torch.float64 if dtype == torch.float64 else torch.float32
        return dtype

    def _converts(self, group, flat: FlatBuffer) -> bool:
        """The eager rule needs converted operands (it then runs in chunks): quantized states always."""
        cdtype = self._compute_dtype(group, flat.dtype, flat.bits)
        x_dtype = flat.master.dtype if flat.master is not None else flat.dtype
        return (group["kahan"] or flat.bits is not None or x_dtype != cdtype or flat.dtype != cdtype
                or any(s.dtype != cdtype for s in flat.states.values()))

    def _ensure_state(self, group, flat: FlatBuffer) -> None:
        """Allocate flat states, master copy and compensation buffer (first step, or after a re-pack)."""
        names = type(self).group_state_names(group)
        if flat.precision is not None and all(n in flat.states for n in names):
            return
        flat.precision = self._precision(group)
        with torch.no_grad():
            for name in names:
                if name not in flat.states:
                    flat.states[name] = self._new_state(group, flat, name)
            if group["master_weights"] and flat.master is None:
                flat.master = flat.data.to(self._master_dtype(group, flat.dtype))
            if group["kahan"] and flat.kahan is None:
                flat.kahan = torch.zeros(flat.numel, dtype=flat.dtype, device=flat.device)
        flat.scratch = []

    def _new_state(self, group, flat: FlatBuffer, name: str):
        """A fresh flat state (its initial value everywhere): a tensor of the state dtype, or, in a
        quantized buffer, a :class:`~dml_optim.core.quant.QuantizedState` (signed unless ``unsigned_states``)."""
        cls = type(self)
        value = cls.initial_state(group, name)
        if flat.bits:
            return QuantizedState.full(flat.numel, value, format_for(flat.bits, signed=name not in cls.unsigned_states),
                                       flat.device)
        return torch.full((flat.numel,), value, dtype=self._state_dtype(group, flat.dtype), device=flat.device)

    def _ensure_scratch(self, group, flat: FlatBuffer, gated: bool, compiled: bool) -> None:
        """Scratch for the eager rule: full size, or one chunk when it converts; none for a compiled
        buffer (the fused kernel needs none; an eager call on it, under a dispatch mode, allocates)."""
        if compiled:
            flat.scratch = []
            return
        converts = self._converts(group, flat)
        size = min(flat.numel, CHUNK_ELEMENTS) if converts else flat.numel
        cdtype = self._compute_dtype(group, flat.dtype, flat.bits)
        count = type(self).scratch_count(group, gated)
        if converts:
            x = flat.master if flat.master is not None else flat.data
            count += conversion_count(x.dtype, flat.dtype, [storage_dtype(s) for s in flat.states.values()], cdtype,
                                      group["kahan"])
        if len(flat.scratch) == count and all(len(s) == size for s in flat.scratch):
            return
        flat.scratch = [torch.empty(size, dtype=cdtype, device=flat.device) for _ in range(count)]

    def _scratch_for_eager(self) -> None:
        """Give every buffer that runs torch's fused kernel the scratch its eager rule uses (a fused step needs
        none), so that a step recorded under a dispatch mode (the audit), which runs the eager rule, runs it
        as DirectML does, with nothing allocated; the next fused step drops it again."""
        for gi, group in enumerate(self.param_groups):
            for flat in self._buffers_of(gi):
                if flat.precision is not None and fuses(self, group, flat):
                    self._ensure_scratch(group, flat, group["capturable"] or group["nonfinite"] == "skip", False)

    @staticmethod
    def _finite(flat: FlatBuffer) -> torch.Tensor:
        """0-d bool on the device: every gradient element is finite (one reduction, no host sync).

        ``max |g| < inf`` is false for an inf and for a NaN (the max propagates NaN).
        """
        if flat.numel == 0:
            return torch.ones((), dtype=torch.bool, device=flat.device)
        return torch.linalg.vector_norm(flat.grad, float("inf")) < math.inf

    def _all_finite(self, flats: list[FlatBuffer]) -> torch.Tensor | None:
        """0-d bool on the first buffer's device: every gradient of ``flats`` is finite (None for none)."""
        finite = None
        for flat in flats:
            ok = self._finite(flat)
            finite = ok if finite is None else finite.logical_and_(ok.to(finite.device))
        return finite

    def _raise_if_nonfinite(self, flats: list[FlatBuffer]) -> None:
        """``nonfinite="raise"``: one host sync per step; names the offending parameters."""
        finite = self._all_finite(flats)
        if finite is None or bool(finite):
            return
        bad = []
        for gi, layout in enumerate(self._layout):
            for flat in layout.buffers:
                if any(flat is f for f in flats):
                    bad += [describe_param(p, idx, gi) for i, (p, idx) in enumerate(zip(flat.params, flat.indices))
                            if p.grad is not None and not bool(torch.isfinite(flat.grad[slice(*flat.span(i))]).all())]
        raise FloatingPointError(f"non-finite gradient (inf or nan) in {', '.join(bad)}; nothing was updated")

    def _run(self, work, gate: Callable[[dict, FlatBuffer], torch.Tensor | None]) -> list:
        """Plan every class update (checks and host coefficients), then commit them; returns the plan."""
        cls = type(self)
        planned = []
        for group, flat in work:
            finite = gate(group, flat)
            if finite is None and fuses(self, group, flat):  # torch's fused kernel, over lists of ranges
                calls = self._fused_plan(group, flat)
                if calls is not None:
                    flat.scratch = []
                    planned.append((group, flat, FUSED, None, None, None, calls))
                    continue
            if flat.pending is not None:  # (a count the fused kernel cannot take: the gradients are gathered)
                foreign = [i for i, g in enumerate(flat.pending) if g is not None and not flat.holds_grad(i, g)]
                flat.pending = None
                flat.gather_grads(foreign)
            if finite is None and len(flat.counter.classes) > 1 and self._masks(group, flat):  # one update, all of it
                runner = masked_runner(self, group, flat)
                self._ensure_scratch(group, flat, True, runner is not None or compiles(self, group, flat))
                planned.append((group, flat, None, None, runner, None, self._masked_plan(group, flat, runner is not None)))
                continue
            runner, key = runner_for(self, group, flat)
            self._ensure_scratch(group, flat, finite is not None, runner is not None or compiles(self, group, flat))
            for c in flat.counter.classes:
                if not c.active:
                    continue
                scalars = None  # host scalars whenever the host knows the count (also a declined runner's fallback)
                if c.count is not None:
                    self._check_step_limit(c.count)
                    if finite is None and not group["capturable"]:
                        scalars = step_scalars(cls, group, c.count, None)
                        self._check_range(group, flat, scalars)
                planned.append((group, flat, c, finite, runner, key, scalars))
        self._commit(work, planned)
        return planned

    def _repeatable(self, work, planned) -> tuple | None:
        """The buffers of a step :meth:`_repeat` may repeat: every buffer of every group stepped, in torch's
        fused kernel, over gradients that are all its own views (or ``None``) or all read in place, with
        nothing a plain step cannot skip (``atomic``, ``nonfinite`` checks); else None."""
        flats = tuple(flat for layout in self._layout for flat in layout.buffers)
        if (self.atomic or len(planned) != len(flats) or any(g["nonfinite"] != "propagate" for g in self.param_groups)
                or any(entry[2] is not FUSED for entry in planned)):
            return None
        if any(a is not b[1] for a, b in zip(flats, work)):
            return None
        # every gradient in its view or None (what a repeat checks without a diagnosis), or every gradient read in place
        if any(not (f.uses is not None or f.fused is not None and f.fused.read is not None) for f in flats):
            return None
        return flats

    def _repeat(self) -> bool:
        """Step the way the last step did, if nothing it depended on changed: True when it stepped.

        After a plain step in which every buffer ran torch's fused kernel (the steady state of a training
        loop: :meth:`_repeatable`), the next step needs no layout work: it checks what could have changed
        (each group's settings and frozen parameters, each buffer's bindings, a dispatch mode; :meth:`step`
        asks for a repeat outside a dynamo trace only, under the grad mode ``torch.no_grad()`` sets) and then
        plans and commits exactly as :meth:`_run` does, through the same functions.  A buffer whose gradients
        were all in their views of the flat buffer (or ``None``) must find them so again
        (:meth:`FlatBuffer.check`); one whose gradients were read where they are (fresh tensors after
        ``zero_grad(set_to_none=True)``, some of them ``None``) reads this step's the same way, after the
        same checks the full path makes of them (:meth:`_reads_again`).  Anything else takes the full path
        (False)."""
        flats = self._steady
        if _dispatch_mode_active() or getattr(self, "found_inf", None) is not None or self.atomic:
            return False
        mode = self.checks
        work, planned = [], []
        n, k = len(flats), 0
        repeated = False
        try:
            for group, layout in zip(self.param_groups, self._layout):
                if (not _unchanged(group, layout.checked) or group["nonfinite"] != "propagate"
                        or (layout.frozen and self._unfrozen(group, layout))):
                    return False
                for flat in layout.buffers:  # (settings validated anew since this buffer's last step: plan anew)
                    if k == n or flat is not flats[k] or flat.settings is not layout.checked:
                        return False
                    if flat.uses is not None:  # (the same parameters without a gradient: the same step classes)
                        if not flat.check(mode):
                            return False
                    elif not self._reads_again(flat, mode):
                        return False
                    k += 1
                    calls = self._fused_plan(group, flat)
                    if calls is None:
                        return False
                    work.append((group, flat))
                    planned.append((group, flat, FUSED, None, None, None, calls))
            repeated = k == n
        finally:
            if not repeated:  # (not repeated, or raised: nothing of it stays)
                for flat in flats:
                    flat.pending = None
        if not repeated:
            return False
        self._commit(work, planned)
        return True

    def _reads_again(self, flat: FlatBuffer, mode: str) -> bool:
        """A repeat of a buffer whose last step read its gradients in place: True when this step's can be read
        in place too, and then ``flat.pending`` holds them.  The checks are the full path's for such a
        buffer: the parameters still bound to the buffer (the data storage's use count,
        :meth:`FlatBuffer.moved`; ``"full"``: every pointer, shape and stride), the gradients dense
        tensors of their parameters' shape, dtype and device (:meth:`FlatBuffer.plain_grads`), contiguous
        and not written into since the last step read them (:func:`dml_optim.backends.fused.reads_in_place`).  The
        buffer's own gradient views back in ``.grad`` (``zero_grad()`` keeping them) take the full path, which
        records them, so the following steps repeat with the binding check."""
        grads = list(map(_GRAD, flat.params))
        index = [i for i, g in enumerate(grads) if g is not None]
        if not index or flat.holds_grad(index[0], grads[index[0]]):
            return False
        if flat.rebound() if mode == "full" else flat.moved("refs") or mode == "fast" and flat.moved("fast"):
            return False  # ("fast" checks the counts too, as FlatBuffer.check does, then the ends)
        if not flat.plain_grads(index, grads) or not reads_in_place(flat, grads, None):
            return False
        flat.counter.split(None if len(index) == len(grads) else [g is not None for g in grads])
        flat.pending = grads
        return True

    def _fused_plan(self, group, flat: FlatBuffer):
        """The kernel calls of a fused step of ``flat`` (:func:`dml_optim.backends.fused.plan`), after the same step-limit
        and range checks as the other paths (the rule's scalars, and torch's kernel's, checked a block of 256
        counts at a time and remembered per settings), or None when a count rules the kernel out."""
        members, counts = flat.counter.active_params() if flat.pending is not None else flat.counter.active_runs()
        calls = plan_fused(self, group, flat, flat.pending, members, counts)
        if calls is None:
            return None
        cls = type(self)
        checked = flat.fused.checked  # (settings, {n // _AHEAD: the counts of that block passed under them})
        if checked[0] is not flat.settings:
            checked = flat.fused.checked = (flat.settings, set())
        if (counts[0] // _AHEAD in checked[1] if len(counts) == 1  # (the constants were checked with the settings)
                else set(map(_AHEAD.__rfloordiv__, counts)) <= checked[1]):
            return calls
        for n in sorted(set(counts)):
            if n // _AHEAD not in checked[1]:
                if self._counts_in_range(group, flat, n - n % _AHEAD, _AHEAD):  # (a block at once: 1 check in 256)
                    if len(checked[1]) >= 64:
                        checked[1].clear()
                    checked[1].add(n // _AHEAD)
                    continue
                self._check_step_limit(n)  # (one of the block's counts is out of range: this one, exactly)
                self._check_range(group, flat, cls.coefficients(group, n + cls.step_offset))
                if not self._counts_in_range(group, flat, n, 1, rule=False):
                    return None  # (the rule's scalars fit, torch's kernel's do not: the rule runs as written)
        return calls

    def _counts_in_range(self, group, flat: FlatBuffer, first: int, n: int, rule: bool = True) -> bool:
        """Counts ``first .. first + n - 1`` are within the step limit and give per-step scalars the compute
        dtype holds: the rule's (with ``rule``; its coefficients computed over a float64 tensor of the counts,
        a few ops for all) and those torch's fused kernel computes (:func:`dml_optim.backends.fused.kernel_scalars`)."""
        cls = type(self)
        if first + n > cls.max_step:
            return False
        cdtype = self._compute_dtype(group, flat.dtype, flat.bits)
        limit = _LIMITS.get(cdtype) or _LIMITS.setdefault(cdtype, torch.finfo(cdtype).max)
        limit *= 1 - 1e-9  # (a margin for the tensor arithmetic's rounding; NaN fails every comparison)
        with _disable_current_modes():  # (host arithmetic on CPU tensors, not the step's work: no recorder sees it)
            return self._counts_fit(group, flat, first, n, limit, rule)

    def _counts_fit(self, group, flat: FlatBuffer, first: int, n: int, limit: float, rule: bool) -> bool:
        cls = type(self)
        counts = torch.arange(first, first + n, dtype=torch.float64, device="cpu")  # (not a default device set)
        worst = []
        if rule:
            worst += [v.abs().max().item() if isinstance(v, torch.Tensor) else abs(v)
                      for v in cls.coefficients(group, counts + cls.step_offset).values()]
        # the kernel's keywords through the buffer's cache (dml_optim.backends.fused._Cache.kernel): the Adams' differ per
        # count, and the steps that follow find the ones of their counts computed here
        kernel = flat.fused.kernel
        if cls.fused_counts == "each":  # (its keywords differ per count: each with its own step number)
            for like in range(first, first + n):
                op, kwargs, _ = kernel(cls, group, flat.settings, like)
                worst.append(kernel_scalars(op, kwargs, like + 1.0))
        else:
            for like in dict.fromkeys((first, first + n - 1)):
                op, kwargs, _ = kernel(cls, group, flat.settings, like)
                worst.append(kernel_scalars(op, kwargs, counts + 1))
        return all(w <= limit for w in worst)

    def _several_counts(self, group, flat: FlatBuffer) -> bool:
        """The parameters of ``flat`` with a gradient have two or more step counts, all known on the host,
        and the buffer can step them in its order (not ``capturable``; operands in the compute dtype: no
        chunks, no Kahan, no quantized states; its own storage): no re-pack for a new ``None`` pattern."""
        if group["capturable"] or not flat.owned or flat.staged or self._converts(group, flat):
            return False
        active = {c.count for c in flat.counter.classes if c.active}
        return len(active) >= 2 and None not in active

    def _masks(self, group, flat: FlatBuffer) -> bool:
        """Whether ``flat`` steps as one masked update (:meth:`_masked_plan`) rather than one update per
        run of parameters at one count: on :data:`MASKED_DEVICES` (DirectML: O(1) ops whatever the
        pattern; CUDA: one kernel instead of a launch per run), with several counts
        (:meth:`_several_counts`) in three or more runs, or two when the masked update compiles."""
        if flat.device.type not in MASKED_DEVICES or not self._several_counts(group, flat):
            return False
        if sum(c.active for c in flat.counter.classes) >= 3:
            return True
        # two runs (e.g. the layers unfrozen last, and the others): two plain eager rules cost fewer
        # passes over memory than one masked eager update; one compiled kernel beats two
        return masked_runner(self, group, flat) is not None

    def _masked_plan(self, group, flat: FlatBuffer, compiled: bool) -> tuple:
        """``(fixed, names, table)`` of one masked update of ``flat`` (range-checked, nothing written).

        Parameters with a gradient at several step counts would take one update per count, and a
        re-pack whenever ``None`` gradients leave a count's parameters in pieces.  Instead the buffer
        steps once, in place and in its order (:func:`dml_optim.core.update.masked_step`): every scalar
        that differs between parameters has one value per parameter (the host's, for the
        parameter's count; the rule's no-op for a parameter without a gradient, whose gradient
        slot is zero), gathered to the elements by their owners (:meth:`FlatBuffer.owner`).  The op
        count does not depend on the pattern; the cost is the owner index (4 bytes per element,
        kept) and one compute-dtype tensor per varying scalar while the step runs (eager).
        """
        classes = flat.counter.classes
        cache = flat.scalars if flat.scalars is not None and flat.scalars[0] is flat.settings else (flat.settings, {})
        known = cache[1]
        by_count = {}
        for c in classes:
            if c.active and c.count not in by_count:
                if c.count not in known:  # (counts advance by one a step: most were computed the step before)
                    self._check_step_limit(c.count)
                    known[c.count] = step_scalars(type(self), group, c.count, None)
                    self._check_range(group, flat, known[c.count])
                by_count[c.count] = known[c.count]
        flat.scalars = (cache[0], by_count)  # (keeps this step's counts only)
        fixed, names, rows = masked_scalars(type(self), group, by_count, [c.count if c.active else None for c in classes],
                                            [c.stop - c.first for c in classes], fold=not compiled)
        table = torch.tensor(rows, dtype=self._compute_dtype(group, flat.dtype, flat.bits), device=flat.device)
        return fixed, names, table.view(len(names), len(flat))

    def _check_step_limit(self, count: int) -> None:
        """Refuse a step beyond the count the class can represent (before any write)."""
        cls = type(self)
        if count + 1 > cls.max_step:
            raise OverflowError(f"{cls.__name__}: this would be step {count + 1} of a parameter, beyond the "
                                f"{cls.max_step} steps it can count ({cls.max_step_reason}); nothing was updated")

    def _check_range(self, group, flat: FlatBuffer, scalars: dict[str, Any]) -> None:
        """Refuse per-step scalars the compute dtype cannot hold (before any write)."""
        cdtype = self._compute_dtype(group, flat.dtype, flat.bits)
        limit = _LIMITS.get(cdtype) or _LIMITS.setdefault(cdtype, torch.finfo(cdtype).max)
        for name, value in scalars.items():
            if isinstance(value, float) and abs(value) > limit:
                raise ValueError(f"{name}={value!r} (from the hyperparameters of this param group) is beyond the "
                                 f"range of {cdtype} (max {limit:g}); nothing was updated")

    def _commit(self, work, planned) -> None:
        """Run the planned updates; then advance the host bookkeeping.

        Only kernels run here.  If one raises (a device fault, an interrupt, an
        injected failure), an optimizer built with ``atomic=True`` restores
        parameters, states and counters from a snapshot taken before the first
        write; otherwise the exception gets a note naming what may have been
        partially updated.
        """
        snapshot = self._snapshot(work) if self.atomic else None
        done = 0
        try:
            for group, flat, c, finite, runner, key, scalars in planned:
                if c is FUSED:  # torch's fused kernel: the calls planned
                    run_fused(scalars)
                elif c is None:  # one masked update of the whole buffer
                    if runner is None or not runner.masked(group, flat, scalars):
                        self._apply_masked(group, flat, scalars)
                    for k in flat.counter.classes:
                        if k.active:
                            k.tensor = None  # the host count advances; a stale device mirror is dropped
                elif runner is None or not runner(group, flat, c, finite, key):
                    timed = group["backend"] in ("auto", "fused") and tiers(flat.device.type, flat.numel, flat.bits is not None)
                    start = time.perf_counter() if timed else 0.0
                    self._apply_eager(group, flat, c, finite, scalars)
                    if timed:  # (CPU ops are synchronous: this is the step's own time)
                        flat.eager_s += time.perf_counter() - start
                done += 1
            for _, flat in work:
                remember_read(flat)
                flat.pending = None
                if flat.staged:
                    flat.stage_out()
        except BaseException as exc:
            for _, flat in work:
                flat.pending = None
            if snapshot is not None:
                for dst, src in snapshot:
                    dst.copy_(src)
            elif hasattr(exc, "add_note"):
                exc.add_note(
                    f"dml_optim: {type(self).__name__}.step() failed while writing (after {done} of {len(planned)} "
                    "updates had finished); parameters and states may be partially updated. Restore a checkpoint, "
                    "or construct the optimizer with atomic=True to roll failed steps back."
                )
            raise
        gated = [entry[1] for entry in planned if entry[3] is not None]  # (the buffers whose step the device gated)
        for group, flat in work:
            flat.counter.advance(group["capturable"] or flat in gated)
            if group["capturable"]:
                flat.counter.forget_host_counts()

    def _snapshot(self, work) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of everything a commit writes (``atomic=True`` only)."""
        tensors = []
        for _, flat in work:
            tensors += flat.tensors()
            tensors += [c.tensor for c in flat.counter.classes if c.tensor is not None]
        return [(t, t.clone()) for t in tensors]

    def _apply_masked(self, group, flat: FlatBuffer, plan: tuple) -> None:
        """One masked update over the whole buffer (:meth:`_masked_plan`), eager; the host counts advance."""
        cls = type(self)
        fixed, names, table = plan
        n = len(flat.scratch) if flat.scratch and len(flat.scratch[0]) >= flat.numel else 0
        masked_step(cls, fixed, names, flat.data, flat.grad, *[flat.states[k] for k in cls.group_state_names(group)],
                    table, flat.owner(), scratch=flat.scratch[:n] + [None] * (cls.scratch_slots - n))

    def _apply_eager(self, group, flat: FlatBuffer, c: StepClass, finite, scalars) -> None:
        """The eager rule over one class, with counts on the host (``scalars`` given) or on the device."""
        cls = type(self)
        if scalars is None:  # counts on the device: the scalars are computed there
            if c.tensor is None:
                flat.counter.ensure_tensors(flat.device)
            scalars = step_scalars(cls, group, c.tensor, finite, coefficient_dtype(flat.device))
        start, end = flat.segment(c.first, c.stop)
        self._apply_range(group, flat, start, end, scalars, finite)
        if c.tensor is not None:
            if c.count is not None and finite is None and not group["capturable"]:
                c.tensor = None  # the host count advances; a stale device mirror is dropped
            else:
                c.tensor.add_(finite.long() if finite is not None else 1)

    def _apply_range(self, group, flat: FlatBuffer, start: int, end: int, scalars, finite) -> None:
        """The rule over elements ``[start, end)``, chunked when operands are converted."""
        cls = type(self)
        names = cls.group_state_names(group)
        x = flat.master if flat.master is not None else flat.data
        out = flat.data if flat.master is not None else None
        cdtype = self._compute_dtype(group, flat.dtype, flat.bits)
        n_rule = cls.scratch_count(group, finite is not None)
        rule_scratch, conversions = flat.scratch[:n_rule], flat.scratch[n_rule:]
        scratch_full = bool(flat.scratch) and len(flat.scratch[0]) >= flat.numel
        if not self._converts(group, flat):
            pad = [None] * (cls.scratch_slots - (len(rule_scratch) if scratch_full else 0))
            if start == 0 and end == flat.numel:  # the common case: the whole buffer, no view op
                scratch = (rule_scratch if scratch_full else []) + pad
                if finite is None:
                    cls.rule(x, flat.grad, *[flat.states[n] for n in names], scratch=scratch, **scalars)
                else:
                    run_rule(cls, x, flat.grad, [flat.states[n] for n in names], scalars, compute_dtype=cdtype,
                             finite=finite, scratch=scratch)
                return
            scratch = ([s[start:end] for s in rule_scratch] if scratch_full else []) + pad
            run_rule(cls, x[start:end], flat.grad[start:end], [flat.states[n][start:end] for n in names], scalars,
                     compute_dtype=cdtype, finite=finite, scratch=scratch)
            return
        chunk = len(flat.scratch[0]) if flat.scratch and len(flat.scratch[0]) else CHUNK_ELEMENTS
        for a in range(start, end, chunk):
            b = min(a + chunk, end)
            k = b - a
            run_rule(cls, x[a:b], flat.grad[a:b], [flat.states[n][a:b] for n in names], scalars,
                     compute_dtype=cdtype, finite=finite, params_out=out[a:b] if out is not None else None,
                     comp=flat.kahan[a:b] if flat.kahan is not None else None, valid=flat.block_valid(a, b),
                     buffers=[t[:k] for t in conversions] if conversions else None,
                     scratch=[s[:k] for s in rule_scratch] + [None] * (cls.scratch_slots - len(rule_scratch)))

    def _unscale(self, work, inv_scale: torch.Tensor) -> torch.Tensor:
        """Unscale the gradients of ``work``; 0-d bool: all of them are finite."""
        for _, flat in work:
            flat.grad.mul_(inv_scale.to(flat.device))
        return self._all_finite([flat for _, flat in work])
