"""Running a flat optimizer's step over its buffers: plan, commit, repeat; non-finite gradients.

:class:`EngineMixin` (a part of :class:`~dml_optim.optimizers.base.FlatOptimizer`) takes the requests
:mod:`~dml_optim.optimizers.layout` prepared (one :class:`~dml_optim.backends.base.StepRequest` per buffer
with a gradient) and runs the update through the one backend interface (:mod:`dml_optim.backends`):

* **plan** (:meth:`EngineMixin._run`): :func:`dml_optim.backends.choose.plan_step` per buffer: the decided
  backend's plan, every check and host coefficient computed before the first write;
* **commit** (:meth:`EngineMixin._commit`): only kernels run (:func:`~dml_optim.backends.choose.run_plan`);
  ``atomic=True`` snapshots first and rolls back a failure; then the host bookkeeping (step classes)
  advances;
* **repeat** (:meth:`EngineMixin._repeat`): after a plain step whose every buffer stepped ungated, the next
  step checks cheaply what could have changed (each group's settings, a scheduler's new scalars
  validated alone; frozen parameters; each buffer's bindings) and plans again through the same
  function, skipping the layout work: every backend, DirectML's eager path included;
* **one range of a buffer** (:meth:`EngineMixin.step_run`, the step inside backward): the parameters of a
  run whose gradients are complete step alone, through the same plan and commit: their gradients read where
  autograd left them (torch's fused kernel) or laid out in a run-sized window
  (:meth:`~dml_optim.core.flat.FlatBuffer.fill_window`); no flat gradient buffer, no re-pack;
* **non-finite gradients**: one device-side reduction per buffer (``nonfinite="skip"`` gates the step on
  it; ``"raise"`` reads it: one sync).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from dml_optim.backends.choose import (EagerPlan, FusedPlan, Owner, StepRequest, copies_in, copy_in, dispatch_mode_active,
                                      ensure_scratch, fuses, plan_step, present_indices, reads_in_place, remember_read,
                                      resolved_backends, run_plan, runtime, tiering_pending)
from dml_optim.core.dtypes import precision
from dml_optim.core.flat import FlatBuffer, describe_param
from dml_optim.core.grads import _FAST_ATTRIBUTES, _GRAD
from dml_optim.optimizers.layout import unfrozen
from dml_optim.optimizers.settings import unchanged
from dml_optim.optimizers.states import ensure_state

__all__ = ["EngineMixin", "Steady"]


class Steady(NamedTuple):
    """What a repeat of the last step needs of one buffer: the buffer, whether its gradients were read in
    place, and its last plan (None for torch's fused kernel: see :meth:`EngineMixin._repeatable`)."""

    flat: FlatBuffer
    in_place: bool
    plan: object
    backend: str


class EngineMixin:
    """The running half of a flat optimizer (see the module docstring)."""

    @property
    def owner(self) -> Owner:
        """What the backends know of this optimizer (:class:`~dml_optim.backends.base.Owner`: its rule, and the
        fallbacks it was told of): every request carries it, never the optimizer.  Made the first time; a copy
        of the optimizer makes its own."""
        owner = self.__dict__.get("_owner")
        if owner is None:
            owner = self.__dict__["_owner"] = Owner(type(self).rule)
        return owner

    @property
    def compile_fallback(self) -> str | None:
        """Why this optimizer's rule runs eager instead of compiled (it was warned, once), or None."""
        return self.owner.compile_fallback

    def resolved_backends(self) -> list[list[str]]:
        """For each param group, the backend each of its flat buffers runs with now (``"fused"``, ``"compiled"``,
        ``"eager"``; :attr:`BufferInfo.backend` per buffer)."""
        return resolved_backends(self.owner, self.buffers_by_group())

    def tiering_pending(self) -> bool:
        """Some buffer runs eagerly under ``backend="auto"`` now and will compile once its eager steps took about
        a compile's time (a benchmark of the steady state steps until this is False)."""
        return tiering_pending(self.owner, self.buffers_by_group())

    def _scratch_for_eager(self) -> None:
        """Give every buffer that runs torch's fused kernel the scratch its eager rule uses (a fused step needs
        none), so that a step recorded under a dispatch mode (the audit), which runs the eager rule, runs it
        as DirectML does, with nothing allocated; the next fused step drops it again."""
        for group, flats in self.buffers_by_group():
            for flat in flats:
                if flat.precision is not None and fuses(self.owner, group, flat):
                    ensure_scratch(type(self).rule, group, flat, group["capturable"] or group["nonfinite"] == "skip", False)

    # -- non-finite gradients ---------------------------------------------------------------------------

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
        for gi, (group, buffers) in enumerate(self.buffers_by_group()):
            for flat in buffers:
                if any(flat is f for f in flats):
                    bad += [describe_param(p, idx, gi) for i, (p, idx) in enumerate(zip(flat.params, flat.indices))
                            if p.grad is not None and not bool(torch.isfinite(flat.grad[slice(*flat.span(i))]).all())]
        raise FloatingPointError(f"non-finite gradient (inf or nan) in {', '.join(bad)}; nothing was updated")

    def _unscale(self, work, inv_scale: torch.Tensor) -> torch.Tensor:
        """Unscale the gradients of ``work`` (``(group, buffer)`` pairs); 0-d bool: all of them are finite."""
        for _, flat in work:
            flat.grad.mul_(inv_scale.to(flat.device))
            flat.write_back()  # (gradients the caller holds: unscaled where they are too)
        return self._all_finite([flat for _, flat in work])

    # -- plan and commit ------------------------------------------------------------------------------------

    def _run(self, requests: list[StepRequest], gate: Callable[[dict, FlatBuffer], torch.Tensor | None]) -> list:
        """Plan every buffer's update (checks and host coefficients; ``gate``: each buffer's device flag, or
        None), then commit them; returns the plans."""
        planned = []
        for request in requests:
            finite = gate(request.group, request.flat)
            if finite is not None:
                request = request._replace(finite=finite)
            planned.append(plan_step(request))
        self._commit(planned)
        for plan in planned:
            runtime(plan.request.flat).repeated = False
        return planned

    def _commit(self, planned: list) -> None:
        """Run the planned updates; then advance the host bookkeeping.

        Only kernels run here.  If one raises (a device fault, an interrupt, an
        injected failure), an optimizer built with ``atomic=True`` restores
        parameters, states and counters from a snapshot taken before the first
        write; otherwise the exception gets a note naming what may have been
        partially updated.
        """
        snapshot = self._snapshot(planned) if self.atomic else None
        done = 0
        try:
            for plan in planned:
                run_plan(plan)
                done += 1
            for plan in planned:
                flat = plan.request.flat
                remember_read(flat, plan.request.grads)  # (the gradients read where the caller keeps them, or None)
                if flat.staged:
                    flat.stage_out()
        except BaseException as exc:
            for plan in planned:
                runtime(plan.request.flat).read = None
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
        for plan in planned:
            group, flat = plan.request.group, plan.request.flat
            flat.counter.advance(group["capturable"] or plan.request.finite is not None)
            if group["capturable"]:
                flat.counter.forget_host_counts()

    @staticmethod
    def _snapshot(planned) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of everything a commit writes (``atomic=True`` only)."""
        tensors = []
        for plan in planned:
            flat = plan.request.flat
            tensors += flat.tensors()
            tensors += [c.tensor for c in flat.counter.classes if c.tensor is not None]
        return [(t, t.clone()) for t in tensors]

    # -- the steady step's repeat ------------------------------------------------------------------------

    def _repeatable(self, planned: list) -> tuple | None:
        """What a next step may repeat (:meth:`_repeat`), one :class:`Steady` per buffer: every buffer of every
        group stepped, ungated, none staged or ``capturable``, none a masked update, each over gradients that are
        all its own views (or ``None``) or, in torch's fused kernel, all read in place; nothing a plain step
        cannot skip (``atomic``, ``nonfinite`` checks); else None."""
        flats = [flat for _, buffers in self.buffers_by_group() for flat in buffers]
        if self.atomic or len(planned) != len(flats) or any(g["nonfinite"] != "propagate" or g["capturable"]
                                                            for g in self.param_groups):
            return None
        for flat, plan in zip(flats, planned):
            if plan.request.flat is not flat or flat.staged or plan.request.finite is not None:
                return None
            if isinstance(plan, EagerPlan) and plan.masked is not None:
                return None
            if flat.uses is None and plan.request.grads is None:
                return None
        # (torch's kernel calls are not kept: they hold views of the buffers, which the binding checks' storage use
        # counts would see, and the gradients read in place, which must not outlive the step)
        return tuple(Steady(plan.request.flat, plan.request.grads is not None,
                            None if type(plan) is FusedPlan else plan, plan.backend) for plan in planned)

    def forget_steady(self) -> None:
        """The next step plans from scratch (settings, bindings, classes): after anything that may change what the
        last step planned for (a param group added, a re-pack, a state dict loaded, a copy, a range stepped alone).
        The repeat's record is the engine's: written here and in :meth:`keep_steady` only."""
        self._steady = None

    def keep_steady(self, planned: list) -> None:
        """After a full step: what the next step may repeat (:meth:`_repeatable`), or nothing."""
        self._steady = self._repeatable(planned)

    def steady_plans(self) -> tuple[Steady, ...]:
        """What the next step may repeat, one :class:`Steady` per buffer (empty when it plans from scratch)."""
        return self._steady or ()

    def _repeat(self) -> bool:
        """Step the way the last step did, if nothing it depended on changed: True when it stepped.

        After a plain step every buffer of which stepped ungated (:meth:`_repeatable`), the next step needs
        no layout work: it checks what could have changed (each group's settings: unchanged, or only
        float scalars such as a scheduler's ``lr``, validated alone, the structure kept; frozen parameters;
        each buffer's bindings; a dispatch mode: :meth:`step` asks for a repeat outside a dynamo trace only,
        under the grad mode ``torch.no_grad()`` sets) and then plans and commits exactly as :meth:`_run`
        does, through the same functions, each backend given its last plan to reuse what it can.  A buffer
        whose gradients were all in their views of the flat buffer (or ``None``) must find them so again
        (:meth:`FlatBuffer.check`); one whose gradients were read where they are (fresh tensors after
        ``zero_grad(set_to_none=True)``, some of them ``None``) reads this step's the same way, after the
        same checks the full path makes of them (:meth:`_reads_again`), or, too small for that or run by
        another backend, copies them into the flat buffer with one op.  Anything else takes the full path
        (False)."""
        steady = self._steady
        if not self.repeat or dispatch_mode_active() or getattr(self, "found_inf", None) is not None or self.atomic:
            return False
        mode = self.checks
        planned, runtimes, kept = [], [], []
        n, k = len(steady), 0
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            if not unchanged(group, layout.checked, layout.watched):
                structure = layout.structure
                try:
                    candidate, synced = self._settings(gi, group, changed=True)
                except (TypeError, ValueError, KeyError):
                    return False  # (the full path names what is wrong)
                self._settle(gi, candidate, synced)
                if layout.structure is not structure:
                    return False
            if group["nonfinite"] != "propagate" or group["capturable"] or (
                    layout.frozen and unfrozen(group, layout, mode)):
                return False
            for flat in layout.buffers:
                if k == n:
                    return False
                flat_, in_place, last, backend = steady[k]
                if flat is not flat_:
                    return False
                rt = runtime(flat)
                if rt.structure is not layout.structure:
                    return False
                grads, copied = None, False
                if flat.uses is not None:  # (the same parameters without a gradient: the same step classes)
                    if not flat.check(mode):
                        return False
                elif not in_place:
                    return False
                else:
                    again = self._reads_again(flat, mode, backend == "fused")
                    if again is None:
                        return False
                    grads, copied = again
                rt.settings = layout.checked
                plan = plan_step(StepRequest(self.owner, group, flat, None, grads, copied), last)
                planned.append(plan)
                runtimes.append(rt)
                # (what made the last step repeatable holds for this one: the same buffers, settings and gates)
                kept.append(Steady(flat, plan.request.grads is not None, None if type(plan) is FusedPlan else plan,
                                   plan.backend))
                k += 1
        if k != n:
            return False
        self._commit(planned)
        for rt in runtimes:
            rt.repeated = True
        self._steady = tuple(kept)
        return True

    def _reads_again(self, flat: FlatBuffer, mode: str, fused: bool = True) -> tuple[list, bool] | None:
        """A repeat of a buffer whose last step read its gradients where the caller keeps them: ``(this step's
        gradients, copied)`` when they can be read in place too, or copied into the flat buffer
        (:func:`dml_optim.backends.fused.copies_in`; done here), else None.  The checks are the full path's for such a
        buffer: the parameters still bound to the buffer (the data storage's use count,
        :meth:`FlatBuffer.moved`; ``"full"``: every pointer, shape and stride), the gradients dense
        tensors of their parameters' shape, dtype and device (:meth:`FlatBuffer.plain_grads`), contiguous
        and not written into since the last step read them (:func:`dml_optim.backends.fused.reads_in_place`).  The
        buffer's own gradient views back in ``.grad`` (``zero_grad()`` keeping them) take the full path, which
        records them, so the following steps repeat with the binding check."""
        with _FAST_ATTRIBUTES():
            grads = list(map(_GRAD, flat.params))
        index = present_indices(grads, None)
        if not index or flat.holds_grad(index[0], grads[index[0]]):
            return None
        if flat.rebound() if mode == "full" else flat.moved("refs") or mode == "fast" and flat.moved("fast"):
            return None  # ("fast" checks the counts too, as FlatBuffer.check does, then the ends)
        if not flat.plain_grads(index, grads):
            return None
        active = None if len(index) == len(grads) else [g is not None for g in grads]
        if not fused and active is not None:  # (another backend steps classes: a new pattern may re-pack)
            return None
        if fused and reads_in_place(flat, grads, None):
            flat.counter.split(active)
            return grads, False
        if not copies_in(flat, grads, None):
            return None
        flat.counter.split(active)
        copy_in(flat, grads)
        return grads, True

    # -- one range of a buffer, inside backward ------------------------------------------------------------

    def set_in_backward(self, handle) -> None:
        """Hand fresh gradients to ``handle`` (a :class:`dml_optim.training.backward.StepInBackward`), or back
        to the buffers' own hooks (None): while a step inside backward takes them, no buffer moves a gradient
        into its flat gradient buffer (:attr:`~dml_optim.core.flat.FlatBuffer.adopt`); the window each buffer
        kept for its runs goes when the handle does."""
        self._in_backward = handle
        for group, flats in self.buffers_by_group():
            for flat in flats:
                if handle is None:
                    runtime(flat).window = None
                self._hook(group, flat)  # (the layout's rule: no buffer adopts while a handle takes gradients)

    @torch.no_grad()
    def step_run(self, buffer: int, grads: dict[int, torch.Tensor], inv_scale: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
        """Step the parameters of flat buffer ``buffer`` (:meth:`flat_buffers`' order) that ``grads`` names (their
        positions in the buffer -> their gradients), alone, now: what the step inside backward calls when a run's
        gradients are complete (:mod:`dml_optim.training.backward`).

        The same rule, checks and bookkeeping as a plain step of those parameters: the group's settings
        validated (a scheduler's new ``lr``), their step counts advanced alone (the buffer's other parameters
        keep theirs), through :func:`~dml_optim.backends.choose.plan_step` and the commit.  torch's fused kernel
        reads the gradients where they are; the other backends read them from a window the size of the run,
        kept per buffer (grown to the largest run; :meth:`~dml_optim.core.flat.FlatBuffer.fill_window`).
        Nothing re-packs and no flat gradient buffer is made.  Raises before writing for a gradient unlike its
        parameter and for settings that do not validate.

        ``inv_scale`` (a 0-d tensor on the device: a loss scaler's ``1 / S``): the gradients are scaled; the run is
        checked on the device (one reduction over its window), its step gated on that flag (a run with an inf or
        NaN gradient changes nothing: parameters, states and step counts stay as they were) and its gradients
        unscaled inside the rule, in the compute dtype (float32 for float16 parameters: no underflow).  Returns
        the flag (0-d bool, True: stepped), else None; nothing is read back to the host."""
        found = [(gi, group, flat) for gi, (group, flats) in enumerate(self.buffers_by_group()) for flat in flats]
        if not 0 <= buffer < len(found):
            raise IndexError(f"buffer {buffer} out of range: the optimizer has {len(found)} flat buffers")
        gi, group, flat = found[buffer]
        layout = self._layout[gi]
        candidate, synced = self._settings(gi, group)
        settings = group if candidate is None else candidate
        if flat.precision is not None and flat.precision != precision(settings):
            raise ValueError(f"param_groups[{gi}]: precision options changed from {flat.precision} to "
                             f"{precision(settings)} after the states were allocated; build a new optimizer")
        self._settle(gi, candidate, synced)
        rt = runtime(flat)
        rt.settings, rt.structure = layout.checked, layout.structure
        if inv_scale is None and fuses(self.owner, group, flat):
            listed = [None] * len(flat.params)
            for i, g in grads.items():
                g = flat.check_run_grad(i, g)
                listed[i] = g if g.is_contiguous() else g.contiguous()
            request = StepRequest(self.owner, group, flat, None, listed, False)
        else:
            first, stop = min(grads), max(grads) + 1
            start, end = flat.segment(first, stop)
            out = rt.window
            if out is None or out.numel() <= end - start or out.dtype != flat.dtype or out.device != flat.device:
                rt.window = out = None  # (the old one freed before the new one is made)
                out = rt.window = torch.zeros(end - start + 1, dtype=flat.dtype, device=flat.device)
            request = StepRequest(self.owner, group, flat, window=flat.fill_window(grads, out))
        finite = None
        if inv_scale is not None:  # (max |g| < inf: false for an inf and for a NaN, which the max propagates)
            finite = torch.linalg.vector_norm(request.window[0][:end - start], float("inf")) < math.inf
            request = request._replace(grad_scale=inv_scale.to(flat.device))
        ensure_state(type(self), group, flat)
        flat.counter.split([i in grads for i in range(len(flat.params))])
        self.forget_steady()
        self._run([request], lambda group, flat: finite)
        return finite
