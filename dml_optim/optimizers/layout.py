"""How a flat optimizer's parameters map to flat buffers, and stay mapped.

:class:`LayoutMixin` (a part of :class:`~dml_optim.optimizers.base.FlatOptimizer`) owns the layout of
each param group (:class:`GroupLayout`): which parameters are packed into which
:class:`~dml_optim.core.flat.FlatBuffer` (the trainable ones, one buffer per device and dtype) and which
are frozen and left out.

Every step starts here (:meth:`LayoutMixin._prepare`), in two phases:

1. **plan** (:meth:`LayoutMixin._plan`, nothing is written): the group's settings are synced with
   torch's names and validated (skipped while they are unchanged since the last step, a tensor setting
   not written into included); each buffer's bindings are checked (:meth:`FlatBuffer.check`) and, only if
   something changed, diagnosed per parameter: foreign gradients are checked, re-bound parameters are
   classified (adopted in place; followed to a new device or dtype by a re-pack; a changed shape
   refused, naming the parameter);
2. **bind** (:meth:`LayoutMixin._bind`): re-packs and adoptions happen, parameters that step together
   are made contiguous, foreign gradients are gathered (one ``cat`` per contiguous run; a gradient the
   caller holds too stays its parameter's ``.grad``) and the slots of ``None`` gradients zeroed.

:meth:`LayoutMixin._follow` does the layout part alone for ``zero_grad``,
``state_dict`` and ``load_state_dict``, so those follow moved parameters too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from dml_optim.backends.choose import StepRequest, copies_in, copy_in, decide, fuses, reads_in_place, runtime, several_counts
from dml_optim.core.dtypes import PRECISION_OPTIONS, check_range, precision
from dml_optim.core.options import LOW_PRECISION_DTYPES
from dml_optim.core.flat import (Binding, FlatBuffer, describe_param, group_key, local_tensor, param_piece,
                                 store_param_piece)
from dml_optim.core.functional import check_like
from dml_optim.core.grads import _runs
from dml_optim.core.quant import BLOCK, MIN_ELEMENTS
from dml_optim.optimizers.rounders import check_rounding, rounding_key
from dml_optim.optimizers.settings import changed_scalars, items, moved, structure_of, tensors_given, unchanged, watch
from dml_optim.optimizers.spec import sync_group
from dml_optim.optimizers.states import ensure_state

__all__ = ["LayoutMixin", "GroupLayout", "unfrozen"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_IS_NONE = partial(operator.is_, None)
_FAST_ATTRIBUTES = torch._C.DisableTorchFunctionSubclass


def _wants_packing(p) -> bool:
    """A parameter belongs in a flat buffer when it is trainable or has a gradient."""
    return p.requires_grad or p.grad is not None


@dataclass
class GroupLayout:
    """The packed form of one param group."""

    buffers: list[FlatBuffer]
    frozen: list[int]  # indices (in the group's params) of parameters not packed (requires_grad=False)
    synced: dict  # torch-name snapshot (spec.sync_group)
    checked: tuple | None = None  # the group's items when last validated: unchanged means valid (the settings token)
    structure: Any = None  # the structure token (dml_optim.optimizers.settings): a new object when the structure changed
    shape: tuple | None = None  # the structural settings it stands for (settings.structure_of)
    watched: tuple = ()  # the settings given as tensors, written into the group as numbers (settings.watch)


# (the names other modules read here)
_items, _unchanged = items, unchanged


def unfrozen(group: dict[str, Any], layout: GroupLayout, checks: str) -> bool:
    """Some unpacked parameter needs packing: it was unfrozen, or (``checks`` other than ``"fast"``) it has a
    gradient although frozen (torch.optim steps every parameter with a gradient)."""
    if not layout.frozen:
        return False
    frozen = operator.itemgetter(*layout.frozen)(group["params"]) if len(layout.frozen) > 1 else (
        group["params"][layout.frozen[0]],)
    with _FAST_ATTRIBUTES():
        if any(map(_REQUIRES_GRAD, frozen)):
            return True
        return checks != "fast" and not all(map(_IS_NONE, map(_GRAD, frozen)))


@dataclass
class _GroupPlan:
    """What one group's step will do (computed without writing anything)."""

    candidate: dict | None  # the validated settings to write back (None: unchanged since the last step)
    synced: dict
    bindings: list[Binding | None]  # per buffer; None: clean
    repack: bool


class LayoutMixin:
    """The layout half of a flat optimizer (see the module docstring)."""

    def _via_host(self, device: torch.device) -> bool:
        return self.pack_via == "host" or (self.pack_via == "auto" and device.type not in ("cpu", "meta"))

    @staticmethod
    def _bits_of(group: dict[str, Any], p) -> int | None:
        """The state bits of parameter ``p`` under ``group``'s ``state_bits``: None for full precision,
        which parameters under :data:`dml_optim.core.quant.MIN_ELEMENTS` elements keep (as bitsandbytes')."""
        bits = group.get("state_bits")
        return bits if bits in BLOCK and local_tensor(p).numel() >= MIN_ELEMENTS else None

    def _pack(self, group: dict[str, Any], indices: Sequence[int]) -> list[FlatBuffer]:
        by_key: dict[tuple, list[int]] = {}
        for i in indices:
            p = group["params"][i]
            by_key.setdefault(group_key(p) + (self._bits_of(group, p),), []).append(i)
        buffers = []
        for key, key_indices in by_key.items():
            params = [group["params"][i] for i in key_indices]
            flat = FlatBuffer(params, key_indices, via_host=self._via_host(local_tensor(params[0]).device), bits=key[-1])
            self._hook(group, flat)
            buffers.append(flat)
        return buffers

    def _hook(self, group: dict[str, Any], flat: FlatBuffer, fused: bool | None = None) -> None:
        """Let the buffer's hooks move fresh gradients into the flat gradient buffer (:meth:`FlatBuffer.hook_grads`),
        unless torch's fused kernel (``fused``: known already) reads them in place or a step inside backward does."""
        if fused is None:
            try:
                fused = decide(self.owner, group, flat).why_not_fused is None  # (not fuses(): it would warn now)
            except (KeyError, TypeError, ValueError):  # (settings not valid yet: the first step decides)
                fused = True
        flat.adopt = not fused and getattr(self, "_in_backward", None) is None
        flat.hook_grads()
        stochastic = group.get("rounding") == "stochastic" and flat.dtype in LOW_PRECISION_DTYPES
        flat.rounding = rounding_key(self, group, flat) if stochastic else None

    def _bits_changed(self, group: dict[str, Any], layout: GroupLayout) -> bool:
        """``state_bits`` changed before any state exists: the buffers must be packed again."""
        return any(flat.precision is None and any(self._bits_of(group, p) != flat.bits for p in flat.params)
                   for flat in layout.buffers)

    def _prepare(self, in_place: bool = False) -> list[tuple[dict, FlatBuffer]]:
        """Validate every group, then bring bindings up to date and allocate states; ``(group, buffer)`` of
        every buffer with at least one gradient (:meth:`step_requests` without the gradients read in place)."""
        return [(r.group, r.flat) for r in self.step_requests()]

    def step_requests(self, in_place: bool = False) -> list[StepRequest]:
        """Validate every group, then bring bindings up to date and allocate states.

        Raises before any parameter or state is written.  Returns a request per buffer that has at least
        one gradient.  ``in_place``: a plain step follows, so a buffer that runs torch's fused kernel may read
        fresh gradients where they are (the request's ``grads``) instead of gathering them.
        """
        plans = [self._plan(gi, group) for gi, group in enumerate(self.param_groups)]
        work = []
        cls = type(self)
        for gi, (group, plan) in enumerate(zip(self.param_groups, plans)):
            layout = self._layout[gi]
            self._settle(gi, plan.candidate, plan.synced)
            if plan.repack:
                self._repack_group(gi)
                bindings = [flat.diagnose() for flat in layout.buffers]
            else:
                bindings = plan.bindings
            for flat, binding in zip(layout.buffers, bindings):
                rt = runtime(flat)
                rt.settings, rt.structure = layout.checked, layout.structure
                active, grads, copied = self._bind(group, flat, binding, in_place)
                if binding is not None:  # (bindings changed: the state the binding checks recognize is recorded anew)
                    flat.record_uses(grads is not None)
                if active is not None and not any(active):
                    continue
                ensure_state(cls, group, flat)
                work.append(StepRequest(self.owner, group, flat, None, grads, copied))
        return work

    def _settings(self, gi: int, group: dict[str, Any], changed: bool = False) -> tuple[dict | None, dict]:
        """``(candidate, synced)``: the group's settings synced with torch's names and validated,
        or ``(None, synced)`` when nothing changed since they were last validated (``changed``: the caller
        found them changed already).  Writes nothing."""
        layout = self._layout[gi]
        if not changed and unchanged(group, layout.checked, layout.watched):
            return None, layout.synced
        if layout.watched:  # (a tensor setting written into in place, ``lr.fill_(x)``: its new value validated)
            group = {**group, **moved(group, layout.watched)}
        scalars = changed_scalars(type(self), group, layout.checked)
        if scalars is not None:  # (a scheduler's lr: those values alone validated, the structure unchanged)
            candidate = dict(group)  # (a C-level copy, then the parameters out)
            candidate.pop("params", None)
            candidate.update(scalars)
            for flat in layout.buffers:
                check_range(candidate, flat, scalars)
            return candidate, layout.synced
        candidate = {k: v for k, v in group.items() if k != "params"}
        candidate["params"] = group["params"]
        synced = sync_group(type(self).spec, candidate, layout.synced, f"param_groups[{gi}]")
        self._check_group(candidate, gi)
        check_rounding(candidate, gi)
        del candidate["params"]
        floats = {h.name: candidate[h.name] for h in type(self).spec.hyperparameters if h.kind == "float"}
        for flat in layout.buffers:
            check_range(candidate, flat, floats)
        return candidate, synced

    def _settle(self, gi: int, candidate: dict | None, synced: dict) -> None:
        """Write validated settings back (a scheduler's write through a torch name reaches ours)."""
        if candidate is None:
            return
        group, layout = self.param_groups[gi], self._layout[gi]
        # (the snapshot itself: only scalars changed, validated alone by _settings)
        scalars_only = layout.structure is not None and synced is layout.synced
        sources = tensors_given(group, layout.watched) if layout.watched or not scalars_only else {}
        group.update(candidate)
        layout.watched = watch(group, sources) if sources else ()
        layout.synced = synced
        layout.checked = items(group)
        if scalars_only:  # (the structure token stays: decisions, kernel keys and argument lists are kept)
            return
        shape = structure_of(type(self), group)
        if shape is None or layout.shape is None or shape != layout.shape:
            layout.structure, layout.shape = object(), shape

    def _settle_all(self) -> None:
        """Sync every valid group's settings with torch's names now (``state_dict`` saves them
        consistent).  A group that does not validate is left as written, like torch.optim saves
        it: saving never raises over a setting, and the next ``step()`` or ``load_state_dict()``
        names the bad value."""
        for gi, group in enumerate(self.param_groups):
            try:
                candidate, synced = self._settings(gi, group)
            except (TypeError, ValueError):
                continue
            self._settle(gi, candidate, synced)

    def _plan(self, gi: int, group: dict[str, Any]) -> _GroupPlan:
        """Everything a group's step needs to know, without writing anything."""
        layout = self._layout[gi]
        candidate, synced = self._settings(gi, group)
        settings = group if candidate is None else candidate
        repack = unfrozen(group, layout, self.checks) or self._bits_changed(settings, layout)
        bindings: list[Binding | None] = []
        for flat in layout.buffers:
            if flat.precision is not None and flat.precision != precision(settings):
                old, new = flat.precision, precision(settings)
                changed = [f"{k} from {a} to {b}" for k, a, b in zip(PRECISION_OPTIONS, old, new) if a != b]
                raise ValueError(f"param_groups[{gi}]: {', '.join(changed)} after the states were allocated is not "
                                 "supported; build a new optimizer with the new options and load_state_dict() into it")
            if flat.check(self.checks):
                bindings.append(None)
                continue
            binding = flat.diagnose()
            if not flat.plain_grads(binding.foreign, binding.grads):  # (one C-level pass per property; per parameter otherwise)
                for i in binding.foreign:
                    self._check_grad(flat, i, gi)
            for i in binding.rebound:
                repack |= self._check_rebound(flat, i, gi)
            bindings.append(binding)
        if repack:
            for i in layout.frozen:
                p = group["params"][i]
                if _wants_packing(p):
                    self._check_param(p, i, gi)
                    if p.grad is not None:
                        check_like(f"grad of {describe_param(p, i, gi)}", local_tensor(p.grad), "the parameter",
                                   local_tensor(p))
        return _GroupPlan(candidate, synced, bindings, repack)

    def _check_grad(self, flat: FlatBuffer, i: int, gi: int) -> None:
        p = flat.params[i]
        grad = p.grad
        t, g = local_tensor(p), local_tensor(grad)
        if g.shape == t.shape and g.dtype == t.dtype and g.device == t.device and not grad.is_sparse:
            return  # (the common case, without building the messages)
        where = describe_param(p, flat.indices[i], gi)
        if grad.is_sparse:
            raise TypeError(f"grad of {where} is sparse; dml_optim supports dense gradients only")
        check_like(f"grad of {where}", local_tensor(grad), "the parameter", local_tensor(p))

    def _check_rebound(self, flat: FlatBuffer, i: int, gi: int) -> bool:
        """A re-bound parameter: can it be followed?  Returns True when the group must be re-packed."""
        p = flat.params[i]
        t = local_tensor(p)
        shape = flat.shapes[i]
        where = describe_param(p, flat.indices[i], gi)
        if t.shape != shape:
            raise RuntimeError(f"{where} was re-bound to a tensor of another shape (it was {tuple(shape)}) after the "
                               "optimizer was created; dml_optim follows moves and casts, not reshapes: create the "
                               "optimizer after changing the model")
        if t.dtype not in type(self).dtypes:
            self._check_param(p, flat.indices[i], gi)
        return t.dtype != flat.dtype or t.device != flat.device or not flat.owned

    def _bind(self, group: dict[str, Any], flat: FlatBuffer, binding: Binding | None,
              in_place: bool = False) -> tuple[list[bool] | None, list | None, bool]:
        """Adopt re-bound parameters, order the step classes, gather foreign gradients.

        A buffer that runs torch's fused kernel, or whose parameters with a gradient are at several step
        counts known on the host (the engine's ``_several_counts``), keeps its order whatever the ``None``
        gradients: it steps once per kernel over lists of runs, in one masked update, or once per run;
        otherwise parameters that step together are made contiguous first (a re-pack, when ``None``
        gradients left a class in pieces), so that the rule runs once per step count.  With ``in_place``
        a fused buffer reads fresh gradients where they are (:func:`dml_optim.backends.fused.reads_in_place`)
        instead of gathering them, or copies them in without adopting them
        (:func:`~dml_optim.backends.fused.copies_in`).  Returns which parameters have a gradient (None: all of
        them), the gradients read this step where the caller keeps them (None: the flat gradient buffer holds
        its own), and whether those were copied into the flat buffer.
        """
        active = foreign = None
        held = binding.held if binding is not None else frozenset()  # (gradients the caller holds too stay theirs)
        if binding is not None:
            if binding.rebound:
                flat.adopt_params(binding.rebound)
            active, foreign = binding.active, binding.foreign
            if not flat.staged and flat.release_held():  # (before a re-pack, gather or zeroing writes into a
                foreign = [i for i, g in enumerate(binding.grads) if g is not None]  # gradient kept elsewhere)
        elif flat.absent:  # (bindings unchanged: the parameters without a gradient are the ones recorded)
            absent = set(map(id, flat.absent))
            active = [id(p) not in absent for p in flat.params]
        if flat.staged:
            flat.stage_in()
        counter = flat.counter
        if active is not None and not any(active):
            return active, None, False
        fused = fuses(self.owner, group, flat)
        self._hook(group, flat, fused)
        if active is None and len(counter.classes) == 1:
            counter.split(None)
        else:
            counter.split(active)
            keep = fused or group["nonfinite"] != "skip" and several_counts(group, flat)
            order = None if keep else counter.order()
            if order is not None and flat.owned:
                flat.permute(order)
                where = {i: pos for pos, i in enumerate(order)}
                foreign = [where[i] for i in foreign] if foreign else foreign
                if active is not None:
                    permuted = [False] * len(active)
                    for i, a in enumerate(active):
                        permuted[where[i]] = a
                    active = permuted
        plain = fused and in_place and group["nonfinite"] == "propagate"  # (torch's kernel, ungated, no checks)
        ungated = in_place and group["nonfinite"] == "propagate" and not group["capturable"]
        if ungated and foreign:
            grads = list(map(_GRAD, flat.params))
            if plain and reads_in_place(flat, grads, active):
                return active, grads, False  # (read by this step's kernels; p.grad stays the caller's, as in torch.optim)
            if ((plain or active is None) and len(foreign) == (len(grads) if active is None else sum(active))
                    and copies_in(flat, grads, active)):
                copy_in(flat, grads)  # (fresh tensors, as after set_to_none: copied, p.grad stays the caller's)
                return active, grads, True
        if active is not None and foreign and len(foreign) == sum(active) and flat.gather_all(active, held):
            return active, None, False  # (one op: every gradient gathered, every None slot zeroed)
        if foreign:
            flat.gather_grads(foreign, held)
        # slots of None gradients may hold an old gradient (inf included): clipping, masked updates and the
        # nonfinite checks read them; torch's fused kernel of a plain step reads the runs with a gradient only
        if active is not None and not plain:
            for first, stop in _runs(counter.inactive()):
                a, b = flat.segment(first, stop)
                flat.ensure_grad()[a:b].zero_()
        return active, None, False

    def _repack_group(self, gi: int, include: set[int] = frozenset()) -> None:
        """Rebuild a group's buffers for its parameters' current devices, dtypes and trainability.

        Existing state is carried over per parameter (cast to the new state
        dtype, moved to the new device, as ``load_state_dict`` does); newly
        trainable parameters start with fresh state, as torch.optim gives them.
        """
        group = self.param_groups[gi]
        layout = self._layout[gi]
        self.forget_steady()
        carried: dict[int, tuple[dict[str, Any], int]] = {}
        for flat in layout.buffers:
            counts = flat.counter.counts()
            sources = dict(flat.states)
            if flat.master is not None:
                sources["master_param"] = flat.master
            if flat.kahan is not None:
                sources["kahan_comp"] = flat.kahan
            for i, gindex in enumerate(flat.indices):
                carried[gindex] = ({k: param_piece(flat, v, i) for k, v in sources.items()}, counts[i])
        members = sorted(set(carried) | {i for i in layout.frozen if i in include or _wants_packing(group["params"][i])})
        layout.frozen = [i for i in range(len(group["params"])) if i not in set(members)]
        old = layout.buffers
        for flat in old:
            flat.unhook_grads()
        layout.buffers = self._pack(group, members)
        spent = max((runtime(flat).eager_s for flat in old), default=0.0)
        for flat in layout.buffers:  # (the group's eager time so far counts for backend="auto"'s tiering)
            runtime(flat).eager_s = spent
        for flat in layout.buffers:  # (the next step reads or gathers the gradients the parameters have)
            if not any(gi_ in carried for gi_ in flat.indices):
                continue
            ensure_state(type(self), group, flat)
            counts = []
            with torch.no_grad():
                for i, gindex in enumerate(flat.indices):
                    states, count = carried.get(gindex, ({}, 0))
                    counts.append(count)
                    for name, src in states.items():
                        dst = {"master_param": flat.master, "kahan_comp": flat.kahan}.get(name, flat.states.get(name))
                        if dst is not None:
                            store_param_piece(flat, dst, i, src)
            flat.counter.set_counts(counts)
        del old

    def _follow(self) -> None:
        """Re-pack groups whose parameters were moved, cast or unfrozen (``zero_grad``, ``state_dict``, loads)."""
        self._check_params()
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            repack = unfrozen(group, layout, self.checks)
            moved = [(flat, flat.rebound()) for flat in layout.buffers if flat.moved(self.checks)]
            for flat, rebound in moved:
                for i in rebound:
                    repack |= self._check_rebound(flat, i, gi)
            if repack:
                self._repack_group(gi)
            else:
                for flat, rebound in moved:
                    if rebound:
                        flat.adopt_params(rebound)

    def _include(self, keys: Sequence[tuple[int, int]]) -> None:
        """Pack the frozen parameters among ``keys`` (``(group, index)``): they are getting state."""
        for gi in sorted({gi for gi, pi in keys if pi in self._layout[gi].frozen}):
            self._repack_group(gi, include={pi for g, pi in keys if g == gi})

    def _buffers_of(self, gi: int) -> list[FlatBuffer]:
        return self._layout[gi].buffers

    def buffers_by_group(self) -> list[tuple[dict, list[FlatBuffer]]]:
        """``(param group, its flat buffers)`` per group, in order."""
        return [(group, layout.buffers) for group, layout in zip(self.param_groups, self._layout)]

    def _locate(self, p) -> tuple[int, FlatBuffer | None, int]:
        """``(group index, buffer or None, position)`` of parameter ``p`` (buffer None: frozen)."""
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            for flat in layout.buffers:
                for i, q in enumerate(flat.params):
                    if q is p:
                        return gi, flat, i
            for i in layout.frozen:
                if group["params"][i] is p:
                    return gi, None, i
        raise KeyError(f"not a parameter of this optimizer: tensor of shape {tuple(getattr(p, 'shape', ()))}")
