"""The gradient side of a flat buffer: the flat gradient buffer, the views handed out, gathering, zeroing.

:class:`GradientsMixin` is a part of :class:`~dml_optim.core.flat.FlatBuffer` (its fields are declared
there).  Gradients become views of one flat gradient buffer once they exist (:meth:`~GradientsMixin.grad_view`,
held weakly, so that a re-bound gradient releases its view); gradients of their own (fresh tensors after
``zero_grad(set_to_none=True)``, a DDP bucket view) are gathered into it, one ``cat`` per contiguous run.
"""

from __future__ import annotations

import operator
import weakref
from itertools import repeat
from functools import partial
from typing import Sequence

import torch

from dml_optim.core.packing import local_tensor

__all__ = ["GradientsMixin", "ZERO_RUNS"]

_GRAD = operator.attrgetter("grad")
#: Reading ``.grad``/``data_ptr()`` of many ``nn.Parameter``s is twice as fast without the
#: per-call ``__torch_function__`` lookup of tensor subclasses (we only read attributes)
_FAST_ATTRIBUTES = torch._C.DisableTorchFunctionSubclass
_IS_NONE = partial(operator.is_, None)
#: ``zero_grad()`` zeroes the whole flat gradient buffer in one op, or, when the parameters without a gradient
#: (frozen after the optimizer was built) hold at least half of it, only the runs of those with one, up to this
#: many ops (torch.optim zeroes the gradients that exist; a frozen backbone's slots are not written every step).
ZERO_RUNS = 4


class GradientsMixin:
    """The flat gradient buffer's methods of :class:`~dml_optim.core.flat.FlatBuffer`."""

    __slots__ = ()

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

