"""The bindings of a flat buffer: whether its parameters and gradients are still the buffer's views.

:class:`BindingsMixin` is a part of :class:`~dml_optim.core.flat.FlatBuffer` (its fields are declared
there).  Between steps, code outside the optimizer can re-bind a parameter (``model.to()``, ``.half()``,
``p.data = t``) or its gradient (``p.grad = t``, ``model.zero_grad()``, a DDP bucket view).
:meth:`~BindingsMixin.check` finds out cheaply when nothing changed (two storage use counts per buffer, and
for ``checks="full"`` two C-level passes over the parameters); only when something changed does
:meth:`~BindingsMixin.diagnose` look at each parameter (a :class:`Binding`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch

from dml_optim.core.grads import _FAST_ATTRIBUTES, _GRAD, _IS_NONE, _storage, held_elsewhere

__all__ = ["Binding", "BindingsMixin"]

_DATA_PTR = torch.Tensor.data_ptr
_OFFSET = torch.Tensor.storage_offset
#: :attr:`BindingsMixin.uses` of a buffer on a device without storage whose parameters were all verified bound is
#: ``(_BOUND_OPAQUE, views)``, ``views`` the number of gradient views handed out then (no use count to record
#: there: :meth:`BindingsMixin.check` compares identities and addresses, and counts the views still alive).
_BOUND_OPAQUE = "bound, no storage"
_IS_NOT_NONE = partial(operator.is_not, None)
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_SHAPE = operator.attrgetter("shape")
_KIND = operator.attrgetter("dtype", "device", "layout")
#: How many tensors (and storage objects) hold a storage: ``torch._C._storage_Use_Count`` (torch >= 2.0), or
#: None where this torch has none (``checks="refs"`` then scans every parameter, as ``"full"`` does).
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
#: The attributes the use counts stand for: a parameter class that overrides ``.grad`` or ``.data`` in Python
#: can answer something no storage count shows, so its buffer is checked parameter by parameter (``"full"``).
_TENSOR_GRAD, _TENSOR_DATA = torch.Tensor.grad, torch.Tensor.data


@dataclass
class Binding:
    """What changed in a buffer's bindings since the last step (:meth:`FlatBuffer.diagnose`).

    ``active``: per parameter, whether it has a gradient (None: all do).
    ``foreign``: parameters whose gradient is not a view of the flat gradient
    buffer (replaced, fresh after ``set_to_none``, a DDP bucket view).
    ``rebound``: parameters whose ``.data`` no longer lives in the buffer.
    ``grads``: each parameter's ``.grad`` as the diagnosis read it.
    ``held``: parameters whose gradient code outside the optimizer holds too
    (:func:`~dml_optim.core.grads.held_elsewhere`): read where it is, never replaced by a view.
    """

    active: list[bool] | None
    foreign: list[int]
    rebound: list[int]
    grads: list
    held: frozenset[int] = frozenset()



class BindingsMixin:
    """The binding checks of :class:`~dml_optim.core.flat.FlatBuffer`."""

    __slots__ = ()

    @property
    def addr(self):
        """Where a tensor lies, as :attr:`ptrs` records it: ``Tensor.data_ptr`` (bytes), or on a device without
        storage ``Tensor.storage_offset`` (elements; :func:`~dml_optim.core.packing.address`)."""
        return _OFFSET if self.opaque else _DATA_PTR

    def _use_counts(self) -> tuple[int, int] | None:
        """How many tensors (and storage objects: ours adds one, constant) hold the storages of ``data``
        and ``grad`` now (None without ``torch._C._storage_Use_Count`` or a gradient buffer)."""
        if _USE_COUNT is None or self.grad is None:
            return None
        stored = self._handles()
        return _USE_COUNT(stored[2]), _USE_COUNT(stored[3])

    def _handles(self) -> tuple:
        """``(data, grad, their storages' handles, their storages)``, kept while ``data`` and ``grad`` stay (the
        storage objects held here add one use each, the same at every count)."""
        stored = self._storages
        if not stored or stored[0] is not self.data or stored[1] is not self.grad:
            grad_storage = self.grad.untyped_storage() if self.grad is not None else None
            stored = self._storages = (self.data, self.grad, self.data.untyped_storage()._cdata,
                                       grad_storage._cdata if grad_storage is not None else None,
                                       self.data.untyped_storage(), grad_storage)
        return stored

    def record_uses(self, read_in_place: bool = False) -> None:
        """After binding: remember the storages' use counts if every parameter is bound to the buffer and
        holds its gradient view (the state :meth:`check` then recognizes without a diagnosis); else forget them.  The data
        storage's count alone is kept whenever every parameter is bound (gradients of their own, read in
        place, change the gradient count at every step; :meth:`moved` still answers from it under ``checks="refs"``)."""
        if self.opaque:  # (no storage, no use count: the bound state alone, checked by identities and addresses)
            self.data_uses = None
            countable = not self.staged
        else:
            countable = not self.staged and self.countable and _USE_COUNT is not None
            self.data_uses = (self.data, _USE_COUNT(self._handles()[2])) if countable else None
        bound = countable and self.grad is not None and not read_in_place
        if bound:  # every gradient its view, or None (a count cannot show a None turning into a tensor: kept apart)
            grads = list(map(_GRAD, self.params))
            ours = self._grads_ours()
            bound = any(ours) and all(o or g is None for o, g in zip(ours, grads))
            self.absent = tuple(p for p, g in zip(self.params, grads) if g is None) if bound else ()
        if bound and self.opaque:
            self.uses = (_BOUND_OPAQUE, len(self.params) - len(self.absent))
        else:
            self.uses = self._use_counts() if bound else None

    def check(self, mode: str) -> bool:
        """True when nothing about the bindings changed since the last step (the fast path).

        Every mode first compares the use counts of the ``data`` and ``grad`` storages with the ones
        recorded when every parameter was last verified bound with its gradient (:meth:`record_uses`):
        a parameter or gradient re-bound away from the buffer (``p.data = t``, ``model.to()``,
        ``p.grad = t``, ``p.grad = None``, ``zero_grad(set_to_none=True)``, a bucket view, a
        ``.grad.data = t``) drops a count, a new view of the buffer raises one; a change is diagnosed
        parameter by parameter.  ``"refs"`` stops there: O(1) whatever the number of parameters
        (a buffer of parameters whose class overrides ``.grad`` or ``.data`` in Python is checked as
        ``"full"``: such an attribute can answer what no count shows).
        On a device without storage (:attr:`opaque`: DirectML) there is no count: every mode compares every
        gradient's identity and address (its storage offset) and counts the gradient views still alive.
        ``"full"`` (the default) also compares every parameter's gradient identity and data pointer (two
        C-level passes), which sees what no count shows: a re-binding
        while the caller holds the old tensor (``grads = [p.grad ...]`` kept, then ``p.grad = None``;
        ``backup = p.detach()``, then ``p.data = t``) and a parameter re-bound to another place in the
        same buffer (``p1.data = p2.data``); ``"fast"`` compares the first and last parameter's.
        Staged buffers always re-read their shards (never in the recorded state: diagnosed every step).
        """
        if self.uses is None or (not self.opaque and self._use_counts() != self.uses):
            return False
        if self.absent:  # (parameters without a gradient still without one: a fresh tensor shows in no count)
            with _FAST_ATTRIBUTES():
                if not all(map(_IS_NONE, map(_GRAD, self.absent))):
                    return False
        if mode == "refs" and self.countable and not self.opaque:
            return True
        params, refs, addr = self.params, self.grad_refs, self.addr
        if mode != "fast" or self.opaque:  # (identity, not ids: a view that died may leave its id to a new tensor)
            views = [ref() if ref is not None else None for ref in refs]
            # (no storage: no count drops when a view dies with its gradient, ``p.grad = None``; the views alive
            # are counted instead, and every mode makes the full passes)
            if self.opaque and sum(map(_IS_NOT_NONE, views)) != self.uses[1]:
                return False
            with _FAST_ATTRIBUTES():  # nn.Parameter's __torch_function__ lookup halves these passes' speed
                if not all(map(operator.is_, views, map(_GRAD, params))):
                    return False
                return list(map(addr, params)) == self.ptrs
        ends = (0, len(params) - 1)
        return all((refs[i]() if refs[i] is not None else None) is params[i].grad
                   and addr(params[i]) == self.ptrs[i] for i in ends)

    def moved(self, mode: str) -> bool:
        """Some parameter's ``.data`` may have left the buffer (``"refs"``: the data storage's use count,
        when recorded; ``"full"``: every pointer; ``"fast"``: the first and last)."""
        if self.staged:
            return False
        recorded = self.data_uses
        if mode == "refs" and recorded is not None and recorded[0] is self.data:
            if _USE_COUNT(self._handles()[2]) == recorded[1]:
                return False
        addr = self.addr
        if mode != "fast" or self.opaque:
            with _FAST_ATTRIBUTES():
                return list(map(addr, self.params)) != self.ptrs
        return any(addr(self.params[i]) != self.ptrs[i] for i in (0, len(self.params) - 1))

    def rebound(self) -> list[int]:
        """Parameters whose ``.data`` no longer is their slice of the buffer."""
        if self.staged:
            return []
        addr = self.addr
        with _FAST_ATTRIBUTES():  # (three C-level passes when nothing moved, the common case)
            if (list(map(addr, self.params)) == self.ptrs and list(map(_SHAPE, self.params)) == self.shapes
                    and all(map(_IS_CONTIGUOUS, self.params)) and self._same_kind()):
                return []
        return [i for i, (p, a, b, shape) in enumerate(zip(self.params, map(addr, self.params), self.ptrs,
                                                              self.shapes))
                if a != b or not p.is_contiguous() or p.shape != shape  # (a reshape keeps the pointer)
                or (self.opaque and (p.dtype, p.device) != (self.dtype, self.device))]

    def _same_kind(self) -> bool:
        """Every parameter still has the buffer's dtype and device: on a device without storage an offset
        does not say which tensor it is in (``model.half()`` gives a new one at the same offset), so
        :meth:`rebound` compares these as well (elsewhere a pointer into the buffer implies them)."""
        if not self.opaque:
            return True
        return set(map(_KIND, self.params)) == {(self.dtype, self.device, torch.strided)}

    def plain_grads(self, indices: Sequence[int], grads: Sequence | None = None) -> bool:
        """The gradients of parameters ``indices`` (``grads``: every parameter's ``.grad``, as read already) are
        dense tensors (no subclass) with their parameters' shapes, dtype and device (C-level passes; a
        parameter-by-parameter check names any other case)."""
        if not indices or self.staged:
            return not indices
        pick = operator.itemgetter(*indices) if len(indices) > 1 else (lambda seq, i=indices[0]: (seq[i],))
        with _FAST_ATTRIBUTES():
            grads = list(pick(grads) if grads is not None else map(_GRAD, pick(self.params)))
            return (set(map(type, grads)) == {torch.Tensor} and list(map(_SHAPE, grads)) == list(pick(self.shapes))
                    and set(map(_KIND, grads)) == {(self.dtype, self.device, torch.strided)})

    def diagnose(self) -> Binding:
        """Per-parameter look at what changed (only called when :meth:`check` is False)."""
        grads = list(map(_GRAD, self.params))
        held = frozenset(i for i, h in enumerate(held_elsewhere(grads)) if h)  # (`grads` the only list of them)
        active = [g is not None for g in grads]
        if self.staged:
            return Binding(None if all(active) else active, [i for i, g in enumerate(grads) if g is not None], [], grads)
        rebound = self.rebound()  # (every pointer, shape and stride: a reshape in place keeps the use counts)
        # model.to() re-binds the .data of the gradient objects we handed out: those are foreign too
        ours = self._grads_ours()  # (identity first: no address is looked up for a gradient not ours)
        foreign = [i for i, (g, o) in enumerate(zip(grads, ours)) if g is not None and not o]
        return Binding(None if all(active) else active, foreign, rebound, grads, held)

    def rebind_pointers(self) -> None:
        """Record the parameters' current data pointers as the bound ones (after a copy re-pointed them)."""
        if not self.staged:
            self.ptrs = list(map(self.addr, self.params))

    def adopt_params(self, moved: Sequence[int]) -> None:
        """Copy re-bound parameters (same dtype, device and shape) back into the buffer and re-point them.

        Exception: if *every* parameter was re-bound to a packed slice of one
        storage, in buffer order and at buffer offsets (what
        ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does), that
        range becomes the flat buffer: nothing is copied, and the other owner
        keeps seeing (and broadcasting) the updated parameters.
        """
        if self._rebase(moved):
            return
        if self.opaque:
            self._refuse_opaque_bucket(moved)
        storages = [_storage(self.params[i]) for i in moved] if not self.opaque else []
        if len(set(storages)) < len(storages):
            raise RuntimeError(
                "parameters of this optimizer were re-bound into a shared buffer by another component "
                "(e.g. ZeroRedundancyOptimizer(parameters_as_bucket_view=True) over a group that also holds "
                "frozen parameters) in a layout dml_optim cannot adopt; copying them back would leave that "
                "buffer stale. Give the optimizer only the parameters that buffer holds, in its order, "
                "or disable the bucket view."
            )
        with torch.no_grad():
            for i in moved:
                p = self.params[i]
                a, b = self.span(i)
                self.data[a:b].copy_(p.detach().reshape(-1))
                p.data = self.data[a:b].view(p.shape)
                self.ptrs[i] = self.addr(p)

    def _rebase(self, moved: Sequence[int]) -> bool:
        """Make the storage all parameters were re-bound into the flat buffer, if they tile it in order."""
        if len(moved) != len(self.params) or self.opaque:
            return False
        first = self.params[0]
        storage = first.untyped_storage()
        base = first.storage_offset()
        for p, offset in zip(self.params, self.offsets):
            if (not p.is_contiguous() or p.untyped_storage().data_ptr() != storage.data_ptr()
                    or p.storage_offset() != base + offset):
                return False
        with torch.no_grad():
            self.data = torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, base, (self.numel,))
        self.ptrs = list(map(_DATA_PTR, self.params))
        self.owned = False
        return True

    def _refuse_opaque_bucket(self, moved: Sequence[int]) -> None:
        """On a device without storage, refuse parameters re-bound into what looks like one shared buffer: every
        parameter moved, each contiguous with its shape, at storage offsets that tile the buffer's layout in order
        (what ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` makes).  There no tensor shows whether
        two tensors share memory, so such a buffer can neither be adopted (it might be separate tensors) nor
        copied back into ours (the other owner would read a stale buffer)."""
        if len(moved) != len(self.params) or len(self.params) < 2:
            return
        params = self.params
        base = params[0].storage_offset() - self.offsets[0]
        if all(p.is_contiguous() and p.shape == shape and p.storage_offset() == base + offset
               for p, shape, offset in zip(params, self.shapes, self.offsets)):
            raise RuntimeError(
                "parameters of this optimizer were re-bound to consecutive slices of what looks like one shared "
                "buffer (as ZeroRedundancyOptimizer(parameters_as_bucket_view=True) does) on a device whose tensors "
                f"have no storage ({self.device}: DirectML): there dml_optim cannot tell whether they share memory, "
                "so it can neither adopt that buffer nor copy them back without leaving it stale. Give the "
                "parameters back tensors of their own (p.data = p.detach().clone()), or re-build the optimizer "
                "over them")

