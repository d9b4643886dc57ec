"""Flat storage: the parameters of a param group packed into contiguous buffers.

One :class:`FlatBuffer` per (param group, device, dtype), holding the group's
*trainable* parameters (``requires_grad=True``; frozen ones are not packed and
cost nothing).  Packing copies each parameter's values into the buffer and
re-points the *same* ``Parameter`` object at its slice (``p.data = view``), so
modules, DDP wrappers and user references keep working.  Gradients get the
same treatment once they exist: ``p.grad`` becomes a view of a flat gradient
buffer, so autograd accumulates straight into it and a step reads one tensor.
The optimizer's states are flat buffers of the same layout.

Memory while packing: each parameter is re-pointed right after its copy, so
its old storage is freed as packing goes (on the CPU, where untouched pages of
the new buffer are not resident, the peak stays near one copy).  Off the CPU
the new buffer is allocated whole, so by default (``pack_via="auto"``) the
parameters are first staged through host memory: the device then never holds
more than about one copy (:func:`dml_optim.core.packing.pack_values`).  The flat
gradient buffer is allocated when the first gradient arrives, not at construction.

Quantized states (``state_bits``) get a buffer of their own with an *aligned*
layout: every parameter starts at a multiple of the block size, zero padding
between parameters (:attr:`FlatBuffer.align`, :meth:`FlatBuffer.span`), so a
block never holds two parameters.

Bindings.  Between steps, code outside the optimizer can re-bind a parameter
(``model.to()``, ``.half()``, ``p.data = t``) or its gradient (``p.grad = t``,
``model.zero_grad()``, a DDP bucket view).  :meth:`FlatBuffer.check` finds
out, cheaply when nothing changed: two storage use counts per buffer (the
gradient views it hands out are held weakly, so a re-bound gradient releases its
view and drops a count) and two C-level passes over the parameters (gradient
identities and data pointers) for the default ``checks="full"``, the counts
alone for ``checks="refs"`` (O(1), blind to a re-binding while the caller holds
the old tensor), the counts and the first and last parameter for
``checks="fast"``.  Only when something changed does
:meth:`FlatBuffer.diagnose` look at each parameter.  Parameters that are distributed tensors (``DTensor``, FSDP2) are
*staged*: the buffer is a working copy of their local shards, copied in and
out around each step (:attr:`FlatBuffer.staged`).

Step counts live in a :class:`~dml_optim.core.steps.StepCounter` per buffer;
:meth:`FlatBuffer.permute` re-packs the buffer when ``None`` gradients left a
class of parameters that step together in pieces.
"""

from __future__ import annotations

import operator
from functools import partial
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from dml_optim.core.packing import describe_param, group_key, is_distributed, local_tensor, pack_values
from dml_optim.core.quant import BLOCK, QuantizedState, block_mask
from dml_optim.core.steps import StepCounter

__all__ = ["FlatBuffer", "Binding", "param_piece", "store_param_piece",
           # (from dml_optim.core.packing, for the modules above)
           "group_key", "describe_param", "local_tensor", "is_distributed", "pack_values"]

_GRAD = operator.attrgetter("grad")
#: Reading ``.grad``/``data_ptr()`` of many ``nn.Parameter``s is twice as fast without the
#: per-call ``__torch_function__`` lookup of tensor subclasses (we only read attributes)
_FAST_ATTRIBUTES = torch._C.DisableTorchFunctionSubclass
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_KIND = operator.attrgetter("dtype", "device", "layout")
_IS_NONE = partial(operator.is_, None)
#: ``zero_grad()`` zeroes the whole flat gradient buffer in one op, or, when the parameters without a gradient
#: (frozen after the optimizer was built) hold at least half of it, only the runs of those with one, up to this
#: many ops (torch.optim zeroes the gradients that exist; a frozen backbone's slots are not written every step).
ZERO_RUNS = 4
#: How many tensors (and storage objects) hold a storage: ``torch._C._storage_Use_Count`` (torch >= 2.0), or
#: None where this torch has none (``checks="refs"`` then scans every parameter, as ``"full"`` does).
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
#: The attributes the use counts stand for: a parameter class that overrides ``.grad`` or ``.data`` in Python
#: can answer something no storage count shows, so its buffer is checked parameter by parameter (``"full"``).
_TENSOR_GRAD, _TENSOR_DATA = torch.Tensor.grad, torch.Tensor.data


# -- the buffer ----------------------------------------------------------------------------------


@dataclass
class Binding:
    """What changed in a buffer's bindings since the last step (:meth:`FlatBuffer.diagnose`).

    ``active``: per parameter, whether it has a gradient (None: all do).
    ``foreign``: parameters whose gradient is not a view of the flat gradient
    buffer (replaced, fresh after ``set_to_none``, a DDP bucket view).
    ``rebound``: parameters whose ``.data`` no longer lives in the buffer.
    ``grads``: each parameter's ``.grad`` as the diagnosis read it.
    """

    active: list[bool] | None
    foreign: list[int]
    rebound: list[int]
    grads: list


class FlatBuffer:
    """The flat storage of one (param group, device, dtype): every field declared here.

    Attributes:
        params: the packed parameters, in buffer order.
        indices: each parameter's index in its param group's ``params`` list.
        offsets: element offset of each parameter; ``offsets[-1]`` is the total (padding included).
        sizes: each parameter's element count (``offsets[i] + sizes[i] <= offsets[i + 1]``).
        bits: the quantized states' bits (8 or 4), or None: full-precision states.
        align: every parameter starts at a multiple of it (1; a quantized buffer: its block size,
            with zero padding between parameters, so that blocks never straddle two parameters).
        valid: per block of ``align`` elements, how many hold values (None without padding).
        shapes: each parameter's (local) shape when packed.
        device, dtype: of the parameters (their local shards, when staged).
        data: the flat parameter buffer (``p.data`` is a view of it, unless staged).
        grad: the flat gradient buffer (None until the first gradient is gathered into it).
        grad_refs: per parameter, a weak reference to the view of ``grad`` that ``p.grad`` was set to
            (:meth:`grad_view`): weak, so that the view lives exactly as long as ``p.grad`` holds it, and
            the count of tensors holding ``grad``'s storage drops when a gradient is re-bound.
        uses: the counts of tensors holding the storages of ``data`` and ``grad`` when every parameter was
            last verified bound to the buffer with its gradient (None: not in that state; see :meth:`check`).
        ptrs: ``p.data_ptr()`` of each parameter when last bound (binding checks).
        states: flat state buffers by name (allocated by the optimizer at its first step): tensors,
            or :class:`~dml_optim.core.quant.QuantizedState` in a quantized buffer.
        master: the FP32 master copy of the parameters (``master_weights=True``) or None.
        kahan: the Kahan compensation buffer (``kahan=True``) or None.
        scratch: the rule's scratch tensors (full size, or one chunk).
        counter: the parameters' step counts.
        precision: the precision options the states were allocated with.
        owned: False when ``data`` is another component's storage (a ZeRO bucket): never re-packed.
        staged: the parameters are DTensors; ``data`` is a working copy of their local shards.
    """

    __slots__ = ("params", "indices", "offsets", "sizes", "bits", "align", "valid", "shapes", "device", "dtype", "data", "grad",
                 "grad_refs", "uses", "data_uses", "absent", "_storages", "countable", "ptrs", "states", "master", "kahan", "scratch", "counter", "precision", "owned", "staged",
                 "_owner", "settings", "eager_s", "scalars", "fused", "pending", "__weakref__")

    def __init__(self, params: Sequence[torch.Tensor], indices: Sequence[int], *, via_host: bool = False,
                 bits: int | None = None):
        self.params = list(params)
        self.indices = list(indices)
        first = local_tensor(self.params[0])
        self.device = first.device
        self.dtype = first.dtype
        self.staged = any(is_distributed(p) for p in self.params)
        locals_ = [local_tensor(p) for p in self.params]
        self.bits = bits
        self.align = BLOCK[bits] if bits else 1
        self._set_layout([t.numel() for t in locals_])
        self.shapes = [t.shape for t in locals_]
        self.data = pack_values(locals_, self.numel, self.dtype, self.device, via_host and not self.staged,
                                rebind=None if self.staged else self.params, offsets=self.offsets)
        self.grad: torch.Tensor | None = None
        self.grad_refs: list[weakref.ref | None] = [None] * len(self.params)
        self.uses: tuple[int, int] | None = None
        self.data_uses: tuple[torch.Tensor, int] | None = None  # (data, its storage's use count) when all were bound
        self.absent: tuple = ()  # the parameters without a gradient when ``uses`` were recorded
        self._storages: tuple = ()
        self.countable = all(type(p).grad is _TENSOR_GRAD and type(p).data is _TENSOR_DATA for p in self.params)
        self.ptrs = [] if self.staged else list(map(_DATA_PTR, self.params))
        self.states: dict[str, torch.Tensor] = {}
        self.master: torch.Tensor | None = None
        self.kahan: torch.Tensor | None = None
        self.scratch: list[torch.Tensor] = []
        self.counter = StepCounter(len(self.params))
        self.precision: tuple | None = None
        self.owned = True
        self.settings: tuple | None = None  # the group's validated settings at this buffer's last step (a token)
        self.scalars: tuple | None = None  # (settings, {count: host scalars}) of the last masked update
        self.eager_s = 0.0  # wall time of its eager steps on the CPU under backend="auto" (the backends' tiering)
        self.fused = None  # the fused backend's step tensors and per-parameter state views (dml_optim.backends.fused)
        self.pending: list | None = None  # this step's gradients read in place (fused backend), else None
        # (gradients the parameters already have stay where they are: the first step reads or gathers them)

    # -- copying and pickling ----------------------------------------------------------

    #: Per-process bookkeeping a copy starts without: weak references to the gradient views handed out
    #: (a copy's parameters hold copies of them), the storage use counts and their storage objects, and
    #: the fused backend's cache (step tensors, views, the gradients read last).
    _TRANSIENT = {"grad_refs": None, "uses": None, "data_uses": None, "absent": (), "_storages": (), "fused": None, "pending": None}

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "__weakref__" and k not in self._TRANSIENT
                and hasattr(self, k)}

    def __setstate__(self, state: dict) -> None:
        for k, v in {**self._TRANSIENT, **state}.items():
            setattr(self, k, v)
        self.grad_refs = [None] * len(self.params)

    # -- layout --------------------------------------------------------------------

    def _set_layout(self, sizes: Sequence[int]) -> None:
        """Offsets (aligned), sizes and per-block valid counts for parameters of ``sizes`` in this order."""
        self.sizes = list(sizes)
        self.offsets = _offsets(self.sizes, self.align)
        self._owner: torch.Tensor | None = None
        self.valid = None
        if self.align > 1 and self.offsets[-1] != sum(self.sizes):
            counts = []
            for n in self.sizes:
                full, rest = divmod(n, self.align)
                counts += [self.align] * full + ([rest] if rest else [])
            self.valid = torch.tensor(counts, dtype=torch.int32, device=self.device)

    @property
    def numel(self) -> int:
        """Elements of every flat tensor (padding included)."""
        return self.offsets[-1]

    def __len__(self) -> int:
        return len(self.params)

    def segment(self, first: int, stop: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of parameters ``[first, stop)`` (with their padding)."""
        return self.offsets[first], self.offsets[stop]

    def span(self, i: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of parameter ``i``'s own values (no padding)."""
        return self.offsets[i], self.offsets[i] + self.sizes[i]

    def owner(self) -> torch.Tensor:
        """Per element, the index of the parameter it belongs to (its padding included): an int32 tensor
        on the device, built the first time a step needs it (a masked step, see the engine) and kept
        until the layout changes (4 bytes per element)."""
        if self._owner is None:
            lengths = torch.tensor([b - a for a, b in zip(self.offsets, self.offsets[1:])], dtype=torch.int64,
                                   device="cpu")  # (host work: not on a default device a caller set)
            index = torch.repeat_interleave(torch.arange(len(self.sizes), dtype=torch.int32, device="cpu"), lengths)
            self._owner = index.to(self.device)  # (repeat_interleave falls back to the CPU on DirectML: built there)
        return self._owner

    def block_valid(self, start: int, end: int) -> torch.Tensor | None:
        """Per-block valid counts of elements ``[start, end)`` (block-aligned), or None without padding."""
        if self.valid is None:
            return None
        return self.valid[start // self.align : -(-end // self.align)]

    def _slices(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        for a, n in zip(self.offsets, self.sizes):
            yield flat[a : a + n]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (local shapes) of a flat tensor of this layout."""
        return [v.view(shape) for shape, v in zip(self.shapes, self._slices(flat))]

    def tensors(self) -> list[torch.Tensor]:
        """Every flat tensor a step writes (parameters, gradients, states, master, compensation)."""
        out = [self.data] + ([self.grad] if self.grad is not None else [])
        for s in self.states.values():
            out += s.tensors() if isinstance(s, QuantizedState) else [s]
        return out + [t for t in (self.master, self.kahan) if t is not None]

    # -- gradients -------------------------------------------------------------------

    def ensure_grad(self, *, filled: bool = True) -> torch.Tensor:
        """The flat gradient buffer, allocated the first time it is needed: zeros, or uninitialized when
        the caller writes every element next (``filled=False``)."""
        if self.grad is None:
            with torch.no_grad():
                alloc = torch.zeros if filled else torch.empty
                self.grad = alloc(self.numel, dtype=self.dtype, device=self.device)
            self.grad_refs = [None] * len(self.params)
        return self.grad

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s view of the flat gradient buffer: the one ``p.grad`` holds, or a new one."""
        ref = self.grad_refs[i]
        view = ref() if ref is not None else None
        a = self.offsets[i]
        if view is None or view.data_ptr() != self.grad.data_ptr() + a * self.grad.element_size():
            # (none yet, or its .data was re-bound away: model.to() does that to the gradients it finds)
            view = self.grad[a : a + self.sizes[i]].view(self.shapes[i])
            self.grad_refs[i] = weakref.ref(view)
        return view

    def holds_grad(self, i: int, g) -> bool:
        """``g`` is parameter ``i``'s view of the flat gradient buffer (the one :meth:`grad_view` made)."""
        ref = self.grad_refs[i]
        return g is not None and ref is not None and ref() is g

    def _grads_ours(self) -> list[bool]:
        """Per parameter: its ``.grad`` is its view of the flat gradient buffer, still pointing there."""
        if self.grad is None:
            return [False] * len(self.params)
        base, size = self.grad.data_ptr(), self.grad.element_size()
        return [g is not None and ref is not None and ref() is g and g.data_ptr() == base + a * size
                for g, ref, a in zip(map(_GRAD, self.params), self.grad_refs, self.offsets)]

    def gather_grads(self, foreign: Sequence[int]) -> None:
        """Copy the gradients of parameters ``foreign`` into the flat buffer and re-point ``p.grad``
        (staged buffers copy the local shards and leave ``p.grad`` alone)."""
        self.ensure_grad()
        with torch.no_grad():
            home = _storage(self.grad)
            # a gradient re-bound to another place of this buffer (two views swapped) is read before any is
            # written: copied out first, all of them, or one run's writes would reach another's source
            sources = {i: local_tensor(self.params[i].grad).reshape(-1) for i in foreign}
            sources = {i: g.clone() if _storage(g) == home else g for i, g in sources.items()}
            for first, stop in _runs(foreign):  # one cat per contiguous run: O(1) ops after a re-pack
                a, b = self.offsets[first], self.offsets[stop]
                grads = [sources[i] for i in range(first, stop)]
                padded = sum(self.sizes[first:stop]) != b - a  # an aligned layout: one copy each
                if len(grads) == 1 or padded:
                    for i, g in zip(range(first, stop), grads):
                        lo, hi = self.span(i)
                        self.grad[lo:hi].copy_(g)
                else:
                    torch.cat(grads, out=self.grad[a:b])
            if not self.staged:
                for i in foreign:
                    self.params[i].grad = self.grad_view(i)

    def gather_all(self, active: Sequence[bool]) -> bool:
        """Gather every gradient and zero the slots of the parameters without one, in one ``cat``, when
        each parameter with a gradient has a foreign one (fresh tensors, as after torch's
        ``zero_grad(set_to_none=True)``) in an unpadded layout; False (nothing done) otherwise."""
        if self.staged or self.align != 1:
            return False
        grads = [local_tensor(p.grad).reshape(-1) if a else None for p, a in zip(self.params, active)]
        home = _storage(self.ensure_grad(filled=False))  # (a new buffer: every element is written below or by
        # the caller's gather and zeroing when this returns False)
        if any(g is not None and _storage(g) == home for g in grads):
            return False  # (a view of our own buffer: cat cannot read what it writes)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        with torch.no_grad():
            torch.cat([g if g is not None else zero.expand(n) for g, n in zip(grads, self.sizes)], out=self.grad)
        for i, a in enumerate(active):
            if a:
                self.params[i].grad = self.grad_view(i)
        return True

    def attach_grads(self) -> None:
        """Point every ``p.grad`` at its view of the flat gradient buffer (staged: no-op)."""
        self.ensure_grad()
        if not self.staged:
            for i, p in enumerate(self.params):
                p.grad = self.grad_view(i)

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients in one op, or set them to ``None`` with none.

        Where the parameters without a gradient (frozen after the optimizer was
        built) hold at least half of the buffer, only the runs of those with one
        are zeroed, one op each, up to :data:`ZERO_RUNS` of them.

        Like torch.optim, a gradient that is ``None`` stays ``None``; a foreign
        gradient tensor is re-pointed at its zeroed view of the flat buffer.
        ``set_to_none`` leaves the buffer as it is: a step, clipping or unscaling
        reads it only after gathering the new gradients and zeroing the slots of
        the parameters left without one (the optimizer's ``_bind``).
        """
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        grads = list(map(_GRAD, self.params))
        if self.staged:
            for g in grads:
                if g is not None:
                    g.zero_()
            return
        if self.grad is None:
            if all(g is None for g in grads):
                return
            self.ensure_grad()
        runs = _runs([i for i, g in enumerate(grads) if g is not None]) if any(map(_IS_NONE, grads)) else ()
        spans = [self.segment(first, stop) for first, stop in runs] if len(runs) <= ZERO_RUNS else ()
        if spans and 2 * sum(b - a for a, b in spans) <= self.numel:
            for a, b in spans:  # (the slots of parameters without a gradient stay as they are: whatever reads the
                self.grad[a:b].zero_()  # buffer zeroes them first, the optimizer's _bind)
        else:
            self.grad.zero_()
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None and not self.holds_grad(i, g):  # a None gradient stays None, as in torch.optim
                p.grad = self.grad_view(i)

    # -- bindings -----------------------------------------------------------------------

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

    def record_uses(self) -> None:
        """After binding: remember the storages' use counts if every parameter is bound to the buffer and
        holds its gradient view (the state :meth:`check` then recognizes without a diagnosis); else forget them.  The data
        storage's count alone is kept whenever every parameter is bound (gradients of their own, read in
        place, change the gradient count at every step; :meth:`moved` still answers from it under ``checks="refs"``)."""
        countable = not self.staged and self.countable and _USE_COUNT is not None
        self.data_uses = (self.data, _USE_COUNT(self._handles()[2])) if countable else None
        bound = countable and self.grad is not None and self.pending is None
        if bound:  # every gradient its view, or None (a count cannot show a None turning into a tensor: kept apart)
            grads = list(map(_GRAD, self.params))
            ours = self._grads_ours()
            bound = any(ours) and all(o or g is None for o, g in zip(ours, grads))
            self.absent = tuple(p for p, g in zip(self.params, grads) if g is None) if bound else ()
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
        ``"full"`` (the default) also compares every parameter's gradient identity and data pointer (two
        C-level passes), which sees what no count shows: a re-binding
        while the caller holds the old tensor (``grads = [p.grad ...]`` kept, then ``p.grad = None``;
        ``backup = p.detach()``, then ``p.data = t``) and a parameter re-bound to another place in the
        same buffer (``p1.data = p2.data``); ``"fast"`` compares the first and last parameter's.
        Staged buffers always re-read their shards (never in the recorded state: diagnosed every step).
        """
        if self.uses is None or self._use_counts() != self.uses:
            return False
        if self.absent:  # (parameters without a gradient still without one: a fresh tensor shows in no count)
            with _FAST_ATTRIBUTES():
                if not all(map(_IS_NONE, map(_GRAD, self.absent))):
                    return False
        if mode == "refs" and self.countable:
            return True
        params, refs = self.params, self.grad_refs
        if mode != "fast":  # (identity, not ids: a view that died may leave its id to a new tensor)
            views = [ref() if ref is not None else None for ref in refs]
            with _FAST_ATTRIBUTES():  # nn.Parameter's __torch_function__ lookup halves these passes' speed
                if not all(map(operator.is_, views, map(_GRAD, params))):
                    return False
                return list(map(_DATA_PTR, params)) == self.ptrs
        ends = (0, len(params) - 1)
        return all((refs[i]() if refs[i] is not None else None) is params[i].grad
                   and params[i].data_ptr() == self.ptrs[i] for i in ends)

    def moved(self, mode: str) -> bool:
        """Some parameter's ``.data`` may have left the buffer (``"refs"``: the data storage's use count,
        when recorded; ``"full"``: every pointer; ``"fast"``: the first and last)."""
        if self.staged:
            return False
        recorded = self.data_uses
        if mode == "refs" and recorded is not None and recorded[0] is self.data:
            if _USE_COUNT(self._handles()[2]) == recorded[1]:
                return False
        if mode != "fast":
            with _FAST_ATTRIBUTES():
                return list(map(_DATA_PTR, self.params)) != self.ptrs
        return any(self.params[i].data_ptr() != self.ptrs[i] for i in (0, len(self.params) - 1))

    def rebound(self) -> list[int]:
        """Parameters whose ``.data`` no longer is their slice of the buffer."""
        if self.staged:
            return []
        with _FAST_ATTRIBUTES():  # (three C-level passes when nothing moved, the common case)
            if (list(map(_DATA_PTR, self.params)) == self.ptrs and list(map(_SHAPE, self.params)) == self.shapes
                    and all(map(_IS_CONTIGUOUS, self.params))):
                return []
        return [i for i, (p, a, b, shape) in enumerate(zip(self.params, map(_DATA_PTR, self.params), self.ptrs,
                                                              self.shapes))
                if a != b or not p.is_contiguous() or p.shape != shape]  # (a reshape keeps the pointer)

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
        active = [g is not None for g in grads]
        if self.staged:
            return Binding(None if all(active) else active, [i for i, g in enumerate(grads) if g is not None], [], grads)
        rebound = self.rebound()  # (every pointer, shape and stride: a reshape in place keeps the use counts)
        home = _storage(self.grad) if self.grad is not None else None
        # model.to() re-binds the .data of the gradient objects we handed out: those are foreign too
        views = [ref() if ref is not None else None for ref in self.grad_refs]  # (identity first: no storage
        foreign = [i for i, (g, view) in enumerate(zip(grads, views))  # is looked up for a gradient not ours)
                   if g is not None and (g is not view or _storage(g) != home)]
        return Binding(None if all(active) else active, foreign, rebound, grads)

    def rebind_pointers(self) -> None:
        """Record the parameters' current data pointers as the bound ones (after a copy re-pointed them)."""
        if not self.staged:
            self.ptrs = list(map(_DATA_PTR, self.params))

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
        storages = [_storage(self.params[i]) for i in moved]
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
                self.ptrs[i] = p.data_ptr()

    def _rebase(self, moved: Sequence[int]) -> bool:
        """Make the storage all parameters were re-bound into the flat buffer, if they tile it in order."""
        if len(moved) != len(self.params):
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

    # -- staged (DTensor) buffers -------------------------------------------------------------

    def stage_in(self) -> None:
        """Copy the local shards of the parameters into the working buffer (staged buffers)."""
        with torch.no_grad():
            _copy_many([t.reshape(-1) for t in self._slices(self.data)],
                       [local_tensor(p).reshape(-1) for p in self.params])

    def stage_out(self) -> None:
        """Copy the updated working buffer back into the local shards (staged buffers)."""
        with torch.no_grad():
            _copy_many([local_tensor(p).view(-1) for p in self.params], list(self._slices(self.data)))

    # -- re-packing ---------------------------------------------------------------------------

    def permute(self, order: Sequence[int]) -> None:
        """Re-pack in parameter ``order`` (same device and dtype), carrying every flat tensor.

        One ``cat`` per flat tensor (a transient second copy of one tensor at
        a time); parameters and gradients are re-pointed at their new slices.
        """
        order = list(order)
        spare = next((s for s in self.scratch if s.numel() == self.numel), None)  # a full-size scratch tensor

        def pieces_of(t: torch.Tensor, per: int = 1) -> list[torch.Tensor]:
            # each parameter with its padding: in an aligned layout the pieces are whole blocks
            bounds = [o // per for o in self.offsets]
            return [t[bounds[i] : bounds[i + 1]] for i in order]

        def repacked(t: torch.Tensor, per: int = 1) -> torch.Tensor:
            pieces = pieces_of(t, per)
            if spare is not None and spare.dtype == t.dtype and spare.numel() == t.numel() and self.owned:
                torch.cat(pieces, out=spare)  # no allocation: through the scratch
                return t.copy_(spare)
            out = torch.empty_like(t)
            torch.cat(pieces, out=out)
            return out

        def repacked_state(s):
            if isinstance(s, QuantizedState):
                per = 2 if s.format.bits == 4 else 1
                return QuantizedState(repacked(s.codes, per), repacked(s.scales, s.format.block), s.format)
            return repacked(s)

        with torch.no_grad():
            data = repacked(self.data)
            grad = repacked(self.grad) if self.grad is not None else None
            states = {k: repacked_state(v) for k, v in self.states.items()}
            master = repacked(self.master) if self.master is not None else None
            kahan = repacked(self.kahan) if self.kahan is not None else None
        ours = self._grads_ours()  # foreign gradients stay where they are
        self.params = [self.params[i] for i in order]
        self.indices = [self.indices[i] for i in order]
        self.shapes = [self.shapes[i] for i in order]
        self._set_layout([self.sizes[i] for i in order])
        self.data, self.grad, self.states, self.master, self.kahan = data, grad, states, master, kahan
        if not self.staged:
            for p, view in zip(self.params, self.views(self.data)):
                p.data = view
            self.ptrs = list(map(_DATA_PTR, self.params))
        self.grad_refs = [None] * len(self.params)
        self.uses = self.data_uses = None
        if self.grad is not None and not self.staged:
            for i, (p, mine) in enumerate(zip(self.params, [ours[i] for i in order])):
                if mine:
                    p.grad = self.grad_view(i)
        self.counter.permute(order)


def param_piece(flat: FlatBuffer, t, i: int):
    """Parameter ``i``'s part of the flat state ``t`` of ``flat``'s layout: a view of its values (shaped
    like the parameter), or, for a :class:`~dml_optim.core.quant.QuantizedState`, its own blocks (a view)."""
    if isinstance(t, QuantizedState):
        return t[flat.offsets[i] : flat.offsets[i + 1]]
    a, b = flat.span(i)
    return t[a:b].view(flat.shapes[i])


def store_param_piece(flat: FlatBuffer, t, i: int, src) -> None:
    """Write parameter ``i``'s part of the flat state ``t`` from ``src`` (a tensor of the parameter's
    values, or the blocks of a quantized state): blocks of the same format are copied bit for bit,
    anything else is decoded and/or encoded (cast as ``load_state_dict`` casts)."""
    n = flat.sizes[i]
    with torch.no_grad():
        if not isinstance(t, QuantizedState):
            values = src.decode(t.dtype)[:n] if isinstance(src, QuantizedState) else local_tensor(src).reshape(-1)
            a, b = flat.span(i)
            t[a:b].copy_(values)
            return
        lo, hi = flat.offsets[i], flat.offsets[i + 1]
        dst = t[lo:hi]
        if isinstance(src, QuantizedState) and src.format == dst.format and src.numel == dst.numel:
            dst.copy_(src.to(dst.device))
            return
        if isinstance(src, QuantizedState):
            values = src.decode(torch.float32)[:n]
        else:
            values = local_tensor(src).reshape(-1)
        work = torch.zeros(hi - lo, dtype=torch.float64 if values.dtype == torch.float64 else torch.float32,
                           device=dst.device)
        work[:n].copy_(values)
        valid = flat.block_valid(lo, hi)
        dst.encode_(work, block_mask(valid, flat.align) if valid is not None else None)


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[first, stop)`` of consecutive numbers in sorted ``indices``."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _offsets(sizes: Sequence[int], align: int = 1) -> list[int]:
    """Start of each of ``sizes`` back to back, each rounded up to ``align``; then the (rounded) total."""
    offsets = [0]
    for n in sizes:
        offsets.append(-(-(offsets[-1] + n) // align) * align)
    return offsets


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _copy_many(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i; one foreach op where torch has it."""
    if not dst:
        return
    if hasattr(torch, "_foreach_copy_") and dst[0].device.type in ("cpu", "cuda"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)
