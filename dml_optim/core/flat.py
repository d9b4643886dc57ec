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

import weakref
from typing import Iterator, Sequence

import torch

from dml_optim.core.bindings import _DATA_PTR, _IS_CONTIGUOUS, _TENSOR_DATA, _TENSOR_GRAD, Binding, BindingsMixin
from dml_optim.core.grads import _FAST_ATTRIBUTES, _GRAD, ZERO_RUNS, GradientsMixin, _runs, _storage
from dml_optim.core.packing import (describe_param, flat_tensor, group_key, is_distributed, local_tensor,
                                    pack_values, storage_less)
from dml_optim.core.quant import BLOCK, QuantizedState, block_mask
from dml_optim.core.steps import StepCounter

__all__ = ["FlatBuffer", "Binding", "param_piece", "store_param_piece", "ZERO_RUNS",
           # (from dml_optim.core.packing, for the modules above)
           "group_key", "describe_param", "local_tensor", "is_distributed", "pack_values"]


# -- the buffer ----------------------------------------------------------------------------------


class FlatBuffer(GradientsMixin, BindingsMixin):
    """The flat storage of one (param group, device, dtype): every field declared here (the methods of its
    gradients and of its bindings live in :mod:`~dml_optim.core.grads` and :mod:`~dml_optim.core.bindings`).

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
        ptrs: each parameter's address when last bound (binding checks): ``p.data_ptr()``, or on a device without
            storage ``p.storage_offset()`` (:attr:`opaque`).
        opaque: the buffer's device has no storage (DirectML): addresses are storage offsets, flat parameter and
            gradient tensors start at offsets of their own into tensors of their own
            (:func:`~dml_optim.core.packing.flat_tensor`), and the binding checks compare identities and addresses
            (no use counts).
        states: flat state buffers by name (allocated by the optimizer at its first step): tensors,
            or :class:`~dml_optim.core.quant.QuantizedState` in a quantized buffer.
        master: the FP32 master copy of the parameters (``master_weights=True``) or None.
        kahan: the Kahan compensation buffer (``kahan=True``) or None.
        scratch: the rule's scratch tensors (full size, or one chunk).
        counter: the parameters' step counts.
        precision: the precision options the states were allocated with.
        owned: False when ``data`` is another component's storage (a ZeRO bucket): never re-packed.
        staged: the parameters are DTensors; ``data`` is a working copy of their local shards.
        hooks: the handles of the post-accumulate-grad hooks that move fresh gradients into ``grad``
            (:meth:`hook_grads`; None: not hooked yet).
        adopt: the hooks move fresh gradients in (False where the buffer runs torch's fused kernel, which
            reads them where they are; the optimizer sets it).
        rounding: the :class:`~dml_optim.core.rounding.RoundingKey` (a stochastic rounder and this buffer's stream)
            that writes the updated float16/bfloat16 parameters (``rounding="stochastic"``; None: to the nearest
            value; the optimizer sets it).
    """

    __slots__ = ("params", "indices", "offsets", "sizes", "bits", "align", "valid", "shapes", "device", "dtype", "data", "grad",
                 "grad_refs", "uses", "data_uses", "absent", "_storages", "countable", "ptrs", "states", "master", "kahan", "scratch", "counter", "precision", "owned", "staged", "opaque", "_canon",
                 "_owner", "hooks", "_where", "adopt", "rounding", "kept", "runtime", "__weakref__")

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
        self.opaque = storage_less(self.data)
        self.grad: torch.Tensor | None = None
        self.grad_refs: list[weakref.ref | None] = [None] * len(self.params)
        self.uses: tuple[int, int] | None = None
        self.data_uses: tuple[torch.Tensor, int] | None = None  # (data, its storage's use count) when all were bound
        self.absent: tuple = ()  # the parameters without a gradient when ``uses`` were recorded
        self._storages: tuple = ()
        self.countable = all(type(p).grad is _TENSOR_GRAD and type(p).data is _TENSOR_DATA for p in self.params)
        self.ptrs = [] if self.staged else list(map(self.addr, self.params))
        self.states: dict[str, torch.Tensor] = {}
        self.master: torch.Tensor | None = None
        self.kahan: torch.Tensor | None = None
        self.scratch: list[torch.Tensor] = []
        self.counter = StepCounter(len(self.params))
        self.precision: tuple | None = None
        self.owned = True
        self.hooks: list | None = None
        self._where: dict[int, int] | None = None
        self.adopt = False
        self.rounding = None
        self.kept: tuple[int, ...] = ()  # gathered gradients the caller holds, left as p.grad (write_back)
        #: what the backends keep of this buffer between steps (:class:`dml_optim.backends.base.BufferRuntime`,
        #: made by them on first use; opaque here, and not copied: a copy decides and plans anew)
        self.runtime = None
        # (gradients the parameters already have stay where they are: the first step reads or gathers them)

    # -- copying and pickling ----------------------------------------------------------

    #: Per-process bookkeeping a copy starts without: weak references to the gradient views handed out
    #: (a copy's parameters hold copies of them), the storage use counts and their storage objects, the
    #: gradient hooks (on the original's parameters: the copy hooks its own at its next step, and decides
    #: ``adopt`` and ``rounding`` again), the backends' runtime (their decision and plans: made again).
    _TRANSIENT = {"grad_refs": None, "uses": None, "data_uses": None, "absent": (), "_storages": (), "hooks": None,
                  "_where": None, "adopt": False,
                  "rounding": None, "kept": (), "_canon": None, "runtime": None}

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "__weakref__" and k not in self._TRANSIENT
                and hasattr(self, k)}

    def __setstate__(self, state: dict) -> None:
        for k, v in {**self._TRANSIENT, "opaque": False, **state}.items():
            if k in self.__slots__:  # (a copy saved by an older version may hold slots since retired)
                setattr(self, k, v)
        self.grad_refs = [None] * len(self.params)
        if self.opaque:  # (a copy of a tensor without storage is a tensor of its own, at offset 0: padded again)
            with torch.no_grad():
                for name in ("data", "grad"):
                    t = getattr(self, name)
                    if t is not None and t.storage_offset() == 0:
                        setattr(self, name, flat_tensor(t.numel(), t.dtype, t.device, zero=False).copy_(t))

    # -- layout --------------------------------------------------------------------

    def _set_layout(self, sizes: Sequence[int]) -> None:
        """Offsets (aligned), sizes and per-block valid counts for parameters of ``sizes`` in this order."""
        self.sizes = list(sizes)
        self.offsets = _offsets(self.sizes, self.align)
        self._owner: torch.Tensor | None = None
        self._canon: list | int | None = None
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

    def draw_start(self, start: int, end: int):
        """The element indices stochastic rounding keys elements ``[start, end)`` on (:class:`~dml_optim.core.rounding.Draws`'
        ``start``): each element's place in the buffer's *canonical* layout, its parameters in the order of their
        indices in the param group (aligned as the buffer is).  That is the buffer's own layout unless ``None``
        gradients re-packed it (:meth:`permute`): ``start`` itself then, else the runs of consecutive indices, so
        that a re-packed buffer, and a fresh optimizer loading its checkpoint, draw the numbers of each element's
        own place."""
        runs = self._canon
        if runs is None:
            order = sorted(range(len(self.params)), key=self.indices.__getitem__)
            canonical = _offsets([self.sizes[i] for i in order], self.align)
            at = dict(zip(order, canonical))
            runs = []  # (buffer start, buffer end, canonical start) of each maximal run
            for i, (a, b) in enumerate(zip(self.offsets, self.offsets[1:])):
                if runs and runs[-1][1] == a and runs[-1][2] + (a - runs[-1][0]) == at[i]:
                    runs[-1] = (runs[-1][0], b, runs[-1][2])
                else:
                    runs.append((a, b, at[i]))
            runs = self._canon = 0 if all(a == c for a, _, c in runs) else runs
        if runs == 0:
            return start
        return tuple((max(a, start) - start, min(b, end) - start, c + max(a, start) - a)
                     for a, b, c in runs if a < end and b > start)

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
            out = flat_tensor(t.numel(), t.dtype, t.device, zero=False) if t is self.data or t is self.grad else \
                torch.empty_like(t)
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
        self._where = None
        self.indices = [self.indices[i] for i in order]
        self.shapes = [self.shapes[i] for i in order]
        self._set_layout([self.sizes[i] for i in order])
        self.data, self.grad, self.states, self.master, self.kahan = data, grad, states, master, kahan
        if not self.staged:
            for p, view in zip(self.params, self.views(self.data)):
                p.data = view
            self.ptrs = list(map(self.addr, self.params))
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



def _offsets(sizes: Sequence[int], align: int = 1) -> list[int]:
    """Start of each of ``sizes`` back to back, each rounded up to ``align``; then the (rounded) total."""
    offsets = [0]
    for n in sizes:
        offsets.append(-(-(offsets[-1] + n) // align) * align)
    return offsets



def _copy_many(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i; one foreach op where torch has it."""
    if not dst:
        return
    if hasattr(torch, "_foreach_copy_") and dst[0].device.type in ("cpu", "cuda"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)
