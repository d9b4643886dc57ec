"""Pack the parameters of a param group into contiguous flat buffers.

One :class:`FlatBuffer` per (param group, device, dtype).  Packing happens
once: each parameter's data is copied into the flat buffer and the *same*
``Parameter`` object is re-pointed at its slice (``p.data = view``), so
modules, DDP wrappers and user references keep working.  Gradients get the
same treatment: ``p.grad`` is a view into a flat gradient buffer, so autograd
accumulates straight into it and a step reads one tensor.  Optimizer states
are flat buffers too, and per-parameter views of them are what
``state_dict()`` exports.

If a user replaces ``p.grad`` (or DDP with ``gradient_as_bucket_view=True``
points it into its own buckets), :meth:`FlatBuffer.gather_grads` copies the
foreign gradients into the flat buffer and re-points ``p.grad`` back; if the
user re-binds ``p.data``, :meth:`FlatBuffer.adopt_params` copies it back in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["FlatBuffer", "Run", "group_key", "describe_param"]


def group_key(p: torch.Tensor) -> tuple[str, torch.dtype]:
    """The (device, dtype) a parameter is packed by."""
    return (str(p.device), p.dtype)


def describe_param(p: torch.Tensor, index: int, group_index: int) -> str:
    """``param_groups[g]['params'][i] (shape (..), dtype)``: how errors name a parameter."""
    return f"param_groups[{group_index}]['params'][{index}] (shape {tuple(p.shape)}, {p.dtype}, {p.device})"


@dataclass(frozen=True)
class Run:
    """A contiguous range of parameters ``[first, stop)`` updated together."""

    first: int
    stop: int
    start: int  # element offset in the flat buffer
    end: int


class FlatBuffer:
    """The flat storage of one (param group, device, dtype).

    Attributes:
        params: the packed parameters, in group order.
        indices: each parameter's index in its param group's ``params`` list.
        offsets: element offset of each parameter; ``offsets[-1]`` is the total.
        data: the flat parameter buffer (every ``p.data`` is a view of it).
        grad: the flat gradient buffer (every ``p.grad`` is a view of it).
        states: flat state buffers by name (allocated by the optimizer).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], indices: Sequence[int]):
        self.params = list(params)
        self.indices = list(indices)
        first = self.params[0]
        self.device = first.device
        self.dtype = first.dtype
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        self.offsets = offsets
        with torch.no_grad():
            self.data = torch.empty(offsets[-1], dtype=self.dtype, device=self.device)
            self.grad = torch.zeros(offsets[-1], dtype=self.dtype, device=self.device)
            for p, view in zip(self.params, self._views(self.data)):
                view.copy_(p.detach().reshape(-1))
            for p, view, gview in zip(self.params, self._views(self.data), self._views(self.grad)):
                if p.grad is not None:
                    gview.copy_(p.grad.detach().reshape(-1))
                p.data = view.view_as(p)
        self.grad_views = [g.view(p.shape) for p, g in zip(self.params, self._views(self.grad))]
        for p, g in zip(self.params, self.grad_views):
            if p.grad is not None:
                p.grad = g
        self._ptrs = [p.data_ptr() for p in self.params]
        self.states: dict[str, torch.Tensor] = {}

    # -- layout --------------------------------------------------------------

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def __len__(self) -> int:
        return len(self.params)

    def _views(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        for a, b in zip(self.offsets[:-1], self.offsets[1:]):
            yield flat[a:b]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (parameter shapes) of a flat buffer of this layout."""
        return [v.view(p.shape) for p, v in zip(self.params, self._views(flat))]

    def runs(self, keys: Sequence) -> list[tuple[object, Run]]:
        """Maximal runs of consecutive parameters with equal ``keys[i]``."""
        out: list[tuple[object, Run]] = []
        first = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or keys[i] != keys[first]:
                out.append((keys[first], Run(first, i, self.offsets[first], self.offsets[i])))
                first = i
        return out

    # -- keeping parameters and gradients in the buffers ----------------------

    def params_moved(self) -> list[int]:
        """Indices of parameters whose ``.data`` no longer lives in the buffer."""
        return [i for i, (p, ptr) in enumerate(zip(self.params, self._ptrs)) if p.data_ptr() != ptr or not p.is_contiguous()]

    def adopt_params(self, moved: Sequence[int]) -> None:
        """Copy re-bound parameters back into the buffer and re-point them.

        Exception: if *every* parameter was re-bound to a packed slice of one
        storage, in buffer order and at buffer offsets (what
        ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does), that
        range becomes the flat buffer: nothing is copied, and the other owner
        keeps seeing (and broadcasting) the updated parameters.
        """
        if self._rebase(moved):
            return
        storages = [self.params[i].untyped_storage().data_ptr() for i in moved]
        if len(set(storages)) < len(storages):
            raise RuntimeError(
                "parameters of this optimizer were re-bound into a shared buffer by another component "
                "(e.g. ZeroRedundancyOptimizer(parameters_as_bucket_view=True) over a group that also holds "
                "frozen parameters) in a layout dml_optim cannot adopt; copying them back would leave that "
                "buffer stale. Give the optimizer only the parameters that buffer holds, in its order, "
                "or disable the bucket view."
            )
        with torch.no_grad():
            for i, p, view in zip(range(len(self)), self.params, self._views(self.data)):
                if i in moved:
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)

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
        self._ptrs = [p.data_ptr() for p in self.params]
        return True

    def grad_status(self) -> tuple[list[bool], list[int]]:
        """``(has_grad, foreign)``: which params have a gradient, and which of
        those gradients are not views of the flat gradient buffer."""
        has_grad: list[bool] = []
        foreign: list[int] = []
        for i, (p, g) in enumerate(zip(self.params, self.grad_views)):
            grad = p.grad
            has_grad.append(grad is not None)
            if grad is not None and grad is not g:
                foreign.append(i)
        return has_grad, foreign

    def gather_grads(self, foreign: Sequence[int]) -> None:
        """Copy foreign gradients into the flat buffer and re-point ``p.grad``."""
        for i in foreign:
            p = self.params[i]
            self.grad_views[i].copy_(p.grad)
            p.grad = self.grad_views[i]

    def attach_grads(self) -> None:
        """Point every ``p.grad`` at its view of the flat gradient buffer
        (for code that writes gradients straight into ``flat.grad``)."""
        for p, g in zip(self.params, self.grad_views):
            p.grad = g

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients in one op (or set them to ``None``).

        Like torch.optim, a gradient that is ``None`` stays ``None``; a foreign
        gradient tensor (replaced by the user, or a DDP bucket view) is
        re-pointed at its zeroed view of the flat buffer.
        """
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.grad.zero_()
        for p, g in zip(self.params, self.grad_views):
            if p.grad is not None and p.grad is not g:  # a None gradient stays None, as in torch.optim
                p.grad = g
