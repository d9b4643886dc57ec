"""The gradient side of a flat buffer: the flat gradient buffer, the views handed out, gathering, zeroing.

:class:`GradientsMixin` is a part of :class:`~dml_optim.core.flat.FlatBuffer` (its fields are declared
there).  Gradients become views of one flat gradient buffer once they exist (:meth:`~GradientsMixin.grad_view`,
held weakly, so that a re-bound gradient releases its view); gradients of their own (fresh tensors after
``zero_grad(set_to_none=True)``, a DDP bucket view) are gathered into it, one ``cat`` per contiguous run.

**Gradients never held twice** (:meth:`~GradientsMixin.hook_grads`).  Under ``zero_grad(set_to_none=True)``
(accelerate, transformers' Trainer) autograd makes a fresh gradient per parameter while the flat gradient
buffer stays allocated: gathered only at the step, every gradient would exist twice at the peak.  A
post-accumulate-grad hook per parameter (torch >= 2.1) copies each fresh gradient into its slot as soon as
autograd has produced it and points ``p.grad`` at the slot's view, so the fresh tensor is freed at once:
one gradient per parameter, plus the one autograd is producing.  A gradient already in its view
(``set_to_none=False``, the second backward of an accumulation) was accumulated there in place: nothing to
do.  Anything else (a bucket view, a subclass, a gradient with a graph, a re-bound parameter) is left where it
is for the step to gather, as before.  The hooks copy only where the buffer does not run torch's fused kernel,
which reads fresh gradients where they are (:attr:`~dml_optim.core.flat.FlatBuffer.adopt`, set by the
optimizer).
"""

from __future__ import annotations

import operator
import sys
import warnings
import weakref
from itertools import repeat
from functools import partial
from typing import Sequence

import torch

from dml_optim.core.packing import contiguous_strides, flat_tensor, local_tensor

__all__ = ["GradientsMixin", "ZERO_RUNS", "HOOKS_AVAILABLE", "held_elsewhere", "zero_in_place"]

_GRAD = operator.attrgetter("grad")
#: Reading ``.grad``/``data_ptr()`` of many ``nn.Parameter``s is twice as fast without the
#: per-call ``__torch_function__`` lookup of tensor subclasses (we only read attributes)
_FAST_ATTRIBUTES = torch._C.DisableTorchFunctionSubclass
_IS_NONE = partial(operator.is_, None)
#: ``zero_grad()`` zeroes the whole flat gradient buffer in one op, or, when the parameters without a gradient
#: (frozen after the optimizer was built) hold at least half of it, only the runs of those with one, up to this
#: many ops (torch.optim zeroes the gradients that exist; a frozen backbone's slots are not written every step).
ZERO_RUNS = 4
#: ``Tensor.register_post_accumulate_grad_hook`` exists (torch >= 2.1): fresh gradients are moved into the flat
#: gradient buffer as autograd produces them.  Without it they are gathered at the step (both copies at the peak).
HOOKS_AVAILABLE = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
_WARNED_NO_HOOKS = []


def _python_refs(grads: list) -> list[int]:
    """The Python reference count of each entry of ``grads``, as this comprehension sees it."""
    return [sys.getrefcount(g) for g in grads]


def _refs(g) -> int:
    """The Python reference count of ``g``, as a caller holding it in one local variable sees it."""
    return sys.getrefcount(g)


def _alone() -> tuple[int, int]:
    """What :func:`_python_refs` and :func:`_refs` read for a gradient that nothing but its parameter (and the
    list, or the local variable) holds: found on a probe, once, so that the interpreter's and torch's own
    references (a tensor C++ still holds keeps one on its Python object in some torch versions) count the
    same for the probe and for a real gradient."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.zeros(1)
    listed = _python_refs([probe.grad])[0]
    g = probe.grad
    return listed, _refs(g)


_ALONE, _ALONE_LOCAL = _alone()


def held_elsewhere(grads: list) -> list[bool]:
    """Per entry of ``grads`` (each parameter's ``.grad``, or None): whether code outside the optimizer holds
    the gradient tensor too (``bufs = [torch.zeros_like(p) ...]``, ``p.grad = b``, then zeroing ``bufs``
    itself), so that its parameter's ``.grad`` must stay that tensor, as in torch.optim: it is read (copied
    into the flat buffer) at every step and never replaced by a view.  ``grads`` must be the only list of them
    the optimizer holds (the hook's test of one gradient in a local variable: ``_refs(g) > _ALONE_LOCAL``).
    A tensor listed twice (two parameters sharing one gradient) counts as held."""
    return [g is not None and n > _ALONE for g, n in zip(grads, _python_refs(grads))]


def zero_in_place(g: torch.Tensor) -> None:
    """Zero gradient ``g`` where it is, as torch.optim's ``zero_grad(set_to_none=False)`` does: detached first
    when it has a graph, else no longer requiring grad (a view, a DDP bucket's, cannot be detached in place)."""
    with torch.no_grad():
        if g.grad_fn is not None:
            g.detach_()
        else:
            g.requires_grad_(False)
        g.zero_()


class GradientsMixin:
    """The flat gradient buffer's methods of :class:`~dml_optim.core.flat.FlatBuffer`."""

    __slots__ = ()

    def ensure_grad(self, *, filled: bool = True) -> torch.Tensor:
        """The flat gradient buffer, allocated the first time it is needed: zeros, or uninitialized when
        the caller writes every element next (``filled=False``)."""
        if self.grad is None:
            with torch.no_grad():
                self.grad = flat_tensor(self.numel, self.dtype, self.device, zero=filled)
            self.grad_refs = [None] * len(self.params)
        return self.grad

    # -- moving fresh gradients in as autograd produces them ----------------------------------------------

    def hook_grads(self) -> None:
        """Hook every trainable parameter so that a fresh gradient moves into its slot of the flat gradient
        buffer as soon as autograd has produced it (see the module's docstring).  Once per buffer (a copy of
        the optimizer hooks again at its next step); staged (DTensor) buffers are not hooked.  Where torch has
        no post-accumulate-grad hooks, warns once and gathers at the step, as before."""
        if self.hooks is not None or self.staged:
            return
        if not HOOKS_AVAILABLE:
            if not _WARNED_NO_HOOKS:
                _WARNED_NO_HOOKS.append(True)
                warnings.warn(f"dml_optim: torch {torch.__version__} has no Tensor.register_post_accumulate_grad_hook "
                              "(torch >= 2.1): under zero_grad(set_to_none=True) every gradient exists twice at the "
                              "step (autograd's and the flat buffer's); zero_grad(set_to_none=False) avoids it",
                              RuntimeWarning, stacklevel=3)
            self.hooks = []
            return
        ref = weakref.ref(self)
        self.hooks = [p.register_post_accumulate_grad_hook(partial(_adopt, ref))
                      for p in self.params if p.requires_grad and p.is_leaf]
        weakref.finalize(self, _remove_hooks, self.hooks)

    def unhook_grads(self) -> None:
        """Remove the hooks :meth:`hook_grads` installed (the buffer is replaced)."""
        _remove_hooks(self.hooks or [])
        self.hooks = None

    def position(self, p) -> int | None:
        """Where parameter ``p`` is in this buffer (None: not here)."""
        where = self._where
        if where is None:
            where = self._where = {id(q): i for i, q in enumerate(self.params)}
        i = where.get(id(p))
        return i if i is not None and self.params[i] is p else None

    def adopt_grad(self, p) -> bool:
        """Move ``p``'s fresh gradient into its slot of the flat gradient buffer and point ``p.grad`` at the
        slot's view (the hook's work): True when it did.  Left alone (False): no gradient, one already in its
        view, or one the step must look at itself (a tensor subclass, a view of another tensor (a DDP bucket),
        one with a graph (``create_graph=True``), one the caller holds too (:func:`held_elsewhere`), another shape,
        dtype or device, sparse, non-contiguous, or a parameter re-bound away from the buffer)."""
        g = p.grad
        if g is None or type(g) is not torch.Tensor or g.requires_grad or g._base is not None:
            return False
        i = self.position(p)
        if i is None or (self.grad is not None and self.holds_grad(i, g)) or _refs(g) > _ALONE_LOCAL:
            return False  # (a gradient the caller holds too stays theirs: the step copies it in)
        if (g.shape != self.shapes[i] or g.dtype != self.dtype or g.device != self.device or g.layout != torch.strided
                or not g.is_contiguous() or self.addr(p) != self.ptrs[i]):
            return False
        if self.grad is not None and _held(self.grad_refs[i], g):
            self.release_grad()  # (the old gradient is the caller's: adopted into a new buffer, not into it)
        grad = self.ensure_grad()  # (zeros: slots of parameters without a gradient are zeroed again at the step)
        if self.in_grad_buffer(g):
            return False
        view = self.grad_view(i)  # (neither it nor ``g`` requires grad: no graph is recorded, no_grad not needed)
        view.copy_(g)
        p.grad = view
        return True

    def release_grad(self) -> None:
        """Give up the flat gradient buffer (copy-on-write): its storage stays with the tensors outside the
        optimizer that hold views of it, a new one is allocated at its next write, and the gradients still
        in the old one are foreign from now on (gathered at the step, as any other)."""
        self.grad = None
        self.grad_refs = [None] * len(self.params)
        self.uses = None  # (the next step diagnoses, and caches holding the old buffer see another one)
        self._storages = ()

    def release_held(self, indices: Sequence[int] | None = None) -> bool:
        """Before writing into the flat gradient buffer: give it up (:meth:`release_grad`) when a view of it
        handed out (``indices``: of those parameters; None: of all) is alive while its parameter's ``.grad``
        is another tensor or None (a gradient the caller kept, ``kept = p.grad`` then ``p.grad = None``: as
        in torch.optim, nothing may write into it again).  True when it did."""
        refs = self.grad_refs
        if self.grad is None or not any(filter(None, refs)):  # (no view handed out: no Python pass)
            return False
        params, alive = self.params, False
        for i in range(len(refs)) if indices is None else indices:
            view = refs[i]() if refs[i] is not None else None
            if view is not None and view is not params[i].grad:
                self.release_grad()
                return True
            alive = alive or view is not None
        if indices is None and not alive:  # (every view died with its gradient: the next check needs no pass)
            self.grad_refs = [None] * len(refs)
        return False

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s view of the flat gradient buffer: the one ``p.grad`` holds, or a new one."""
        ref = self.grad_refs[i]
        view = ref() if ref is not None else None
        a = self.offsets[i]
        if view is None or self.addr(view) != self.grad_addr(a):
            # (none yet, or its .data was re-bound away: model.to() does that to the gradients it finds)
            shape = self.shapes[i]  # (one view op, not a slice and a view: the hook makes one per fresh gradient)
            view = self.grad.as_strided(shape, contiguous_strides(shape), self.grad.storage_offset() + a)
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
        addr, at = self.addr, self.grad_addr
        return [g is not None and ref is not None and ref() is g and addr(g) == at(a)
                for g, ref, a in zip(map(_GRAD, self.params), self.grad_refs, self.offsets)]

    def grad_addr(self, offset: int) -> int:
        """The address (:func:`~dml_optim.core.packing.address`) of element ``offset`` of the flat gradient buffer."""
        grad = self.grad
        return grad.storage_offset() + offset if self.opaque else grad.data_ptr() + offset * grad.element_size()

    def in_grad_buffer(self, g) -> bool:
        """``g`` lies in the flat gradient buffer's memory (a view of it: one handed out, or two swapped).  On a device
        without storage no tensor shows its memory: a view handed out (held, identity) is recognized, a view of the
        buffer made otherwise (slicing ``flat_buffers()[i].grad``) is not (docs/guide/directml-on-linux.md)."""
        if self.grad is None or g is None:
            return False
        if not self.opaque:
            return _storage(g) == _storage(self.grad)
        return any(ref is not None and ref() is g for ref in self.grad_refs)

    def gather_grads(self, foreign: Sequence[int], keep: frozenset[int] = frozenset()) -> None:
        """Copy the gradients of parameters ``foreign`` into the flat buffer and re-point ``p.grad``, except
        the parameters in ``keep`` (gradients the caller holds too: :func:`held_elsewhere`) and those of staged
        buffers (the local shards are copied, ``p.grad`` left alone)."""
        if self.release_held(foreign):  # (the others hold their views, in the buffer given up: gathered too)
            foreign = [i for i, p in enumerate(self.params) if p.grad is not None]
        self.ensure_grad()
        with torch.no_grad():
            # a gradient re-bound to another place of this buffer (two views swapped) is read before any is
            # written: copied out first, all of them, or one run's writes would reach another's source
            sources = {i: local_tensor(self.params[i].grad) for i in foreign}
            sources = {i: (g.clone() if self.in_grad_buffer(g) else g).reshape(-1) for i, g in sources.items()}
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
                    if i not in keep:
                        self.params[i].grad = self.grad_view(i)
                self.kept = tuple(i for i in foreign if i in keep)

    def gather_all(self, active: Sequence[bool], keep: frozenset[int] = frozenset()) -> bool:
        """Gather every gradient and zero the slots of the parameters without one, in one ``cat``, when
        each parameter with a gradient has a foreign one (fresh tensors, as after torch's
        ``zero_grad(set_to_none=True)``) in an unpadded layout; False (nothing done) otherwise.  ``p.grad``
        becomes its view, except for the parameters in ``keep`` (:meth:`gather_grads`)."""
        if self.staged or self.align != 1:
            return False
        grads = [local_tensor(p.grad).reshape(-1) if a else None for p, a in zip(self.params, active)]
        self.release_held()
        self.ensure_grad(filled=False)  # (a new buffer: every element is written below or by the caller's gather
        # and zeroing when this returns False)
        if any(self.in_grad_buffer(local_tensor(p.grad)) for p, a in zip(self.params, active) if a):
            return False  # (a view of our own buffer: cat cannot read what it writes)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        with torch.no_grad():
            torch.cat([g if g is not None else zero.expand(n) for g, n in zip(grads, self.sizes)], out=self.grad)
        for i, a in enumerate(active):
            if a and i not in keep:
                self.params[i].grad = self.grad_view(i)
        self.kept = tuple(i for i, a in enumerate(active) if a and i in keep)
        return True

    def write_back(self) -> None:
        """After a write into the flat gradient buffer (a clip, an unscale): copy the slots of the gradients
        the caller holds (:attr:`kept` by the last gather as their parameters' ``.grad``) back into them, so the
        write reaches the tensors ``p.grad`` is, as in torch.optim."""
        for i in self.kept:
            g = self.params[i].grad
            if g is not None and not self.holds_grad(i, g):
                lo, hi = self.span(i)
                with torch.no_grad():
                    g.copy_(self.grad[lo:hi].view(g.shape))

    def check_run_grad(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """``g`` (its local tensor) when it is a dense gradient of parameter ``i``'s shape, dtype and device; else
        ``TypeError`` naming both (a range stepping alone: :meth:`fill_window`, or torch's kernel reading it)."""
        g = local_tensor(g)
        if g.shape != self.shapes[i] or g.dtype != self.dtype or g.device != self.device or g.layout != torch.strided:
            raise TypeError(f"gradient of parameter {i} of the buffer ({tuple(g.shape)}, {g.dtype}, {g.device}, "
                            f"{g.layout}) is unlike the parameter ({tuple(self.shapes[i])}, {self.dtype}, "
                            f"{self.device}, dense)")
        return g

    def fill_window(self, grads: dict[int, torch.Tensor], out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Lay out ``grads`` (position in the buffer -> gradient) as the buffer lays out their parameters, in
        the first elements of ``out`` (a tensor of the buffer's dtype whose last element is zero and stays so):
        ``(window, its first element in the buffer)``, the window covering the parameters from the first to the
        last of ``grads``.  One ``cat`` (a ``copy_`` for one gradient without padding); padding and the slots of
        parameters between them without a gradient read zero.  For a range that steps alone (the step inside
        backward): no flat gradient buffer.  Raises (nothing written) for a gradient unlike its parameter."""
        first, stop = min(grads), max(grads) + 1
        start, end = self.segment(first, stop)
        if end - start >= out.numel():
            raise RuntimeError(f"dml_optim: a gradient window of {out.numel() - 1} elements cannot hold "
                               f"[{start}, {end})")
        zero = out[-1:]
        pieces = []
        for i in range(first, stop):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            g = grads.get(i)
            if g is None:
                pieces.append(zero.expand(hi - lo))
                continue
            g = self.check_run_grad(i, g)
            pieces.append(g.reshape(-1))
            if hi - lo > self.sizes[i]:
                pieces.append(zero.expand(hi - lo - self.sizes[i]))
        window = out[:end - start]
        with torch.no_grad():
            if len(pieces) == 1:
                window.copy_(pieces[0])
            else:
                torch.cat(pieces, out=window)
        return window, start

    def attach_grads(self) -> None:
        """Point every ``p.grad`` at its view of the flat gradient buffer (staged: no-op)."""
        if not self.staged:
            self.release_held()  # (a view kept elsewhere is not handed back, nor written through)
        self.ensure_grad()
        if not self.staged:
            for i, p in enumerate(self.params):
                p.grad = self.grad_view(i)

    def zero_grad(self, set_to_none: bool, mode: str = "full") -> None:
        """Zero the gradients in one op, or set them to ``None`` with none.

        Where the parameters without a gradient (frozen after the optimizer was
        built) hold at least half of the buffer, only the runs of those with one
        are zeroed, one op each, up to :data:`ZERO_RUNS` of them.

        Like torch.optim, a gradient that is ``None`` stays ``None``; a foreign
        gradient tensor is re-pointed at its zeroed view of the flat buffer, or zeroed where it is when the
        caller holds it too (:func:`held_elsewhere`).
        ``set_to_none`` leaves the buffer as it is: a step, clipping or unscaling
        reads it only after gathering the new gradients and zeroing the slots of
        the parameters left without one (the optimizer's ``_bind``).
        """
        if set_to_none:  # (one C-level pass)
            with _FAST_ATTRIBUTES():
                any(map(setattr, self.params, repeat("grad", len(self.params)), repeat(None, len(self.params))))
            return
        grads = list(map(_GRAD, self.params))
        if self.staged:
            for g in grads:
                if g is not None:
                    g.zero_()
            return
        ours = None  # (bound as the last step left them, by the step's full check: every one its view; the other
        # modes' blind spots (a gradient replaced while its view is kept) are healed here, as they always were)
        if self.grad is None or self.uses is None or mode != "full" or not self.check(mode):
            # per parameter: its .grad is its view, still pointing there (a ``.grad.data = t`` re-points the view
            # itself: ``model.to()`` and ``.half()`` do); only the others can leave a view held elsewhere
            ours = self._grads_ours()
            if not all(ours) and self.release_held([i for i, o in enumerate(ours) if not o]):
                ours = [False] * len(ours)  # (a gradient kept after its parameter's was released: torch leaves it)
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
        held = held_elsewhere(grads) if ours is not None and not all(ours) else ()  # (`grads` the only list)
        for i, (p, g, o, h) in enumerate(zip(self.params, grads, ours or (), held)):  # a None gradient stays
            if g is None or o:  # None, as in torch.optim; any other not its view gets its zeroed view, or is
                continue  # zeroed where it is when the caller holds it too (torch's way)
            if h:
                zero_in_place(g)
            else:
                p.grad = self.grad_view(i)


def _adopt(ref: weakref.ref, p) -> None:
    """The post-accumulate-grad hook of a parameter of the buffer ``ref`` refers to (a weak reference: the hook
    does not keep an optimizer alive)."""
    flat = ref()
    if flat is not None and flat.adopt:
        flat.adopt_grad(p)


def _held(ref: weakref.ref | None, g) -> bool:
    """The view ``ref`` refers to is alive, and is not ``g`` (its parameter's ``.grad``): held elsewhere."""
    view = ref() if ref is not None else None
    return view is not None and view is not g


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[first, stop)`` of consecutive numbers in sorted ``indices``."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()

