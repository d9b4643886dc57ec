"""Parameters and their values on their way into a flat buffer: distributed tensors, and packing.

* :func:`is_distributed`, :func:`local_tensor`: a ``DTensor`` (FSDP2,
  tensor parallel) and the shard this rank holds;
* :func:`group_key`, :func:`describe_param`: how parameters are grouped into
  buffers and named in errors;
* :func:`pack_values`: many tensors copied into one new flat tensor with a
  bounded memory peak (each source re-pointed at its slice as soon as it is
  filled), optionally staged through host memory, and undone on failure;
* :func:`contiguous_strides`: the strides of a packed (row-major) shape.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

__all__ = ["is_distributed", "local_tensor", "group_key", "describe_param", "pack_values", "contiguous_strides"]


@lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a packed tensor of ``shape`` (a tuple), as torch computes them: a dimension of
    size 0 counts as 1.  Cached: a gradient hook makes a view of this shape for every fresh gradient."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# -- distributed tensors ------------------------------------------------------------


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor  # torch >= 2.5
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # torch 2.4
        except ImportError:  # a build without torch.distributed
            return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_distributed(t) -> bool:
    """True for a ``DTensor`` (an FSDP2 / tensor-parallel parameter or gradient)."""
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: the local shard of a ``DTensor``, else ``t`` itself."""
    return t._local_tensor if is_distributed(t) else t


def group_key(p: torch.Tensor) -> tuple[str, torch.dtype]:
    """The (device, dtype) a parameter is packed by (a DTensor's local device)."""
    return (str(local_tensor(p).device), p.dtype)


def describe_param(p: torch.Tensor, index: int, group_index: int) -> str:
    """``param_groups[g]['params'][i] (shape (..), dtype, device)``: how errors name a parameter."""
    return f"param_groups[{group_index}]['params'][{index}] (shape {tuple(p.shape)}, {p.dtype}, {local_tensor(p).device})"


# -- packing values with a bounded peak ------------------------------------------------------


def pack_values(sources: Sequence[torch.Tensor], numel: int, dtype: torch.dtype, device: torch.device,
                via_host: bool, rebind: Sequence[torch.Tensor] | None = None,
                offsets: Sequence[int] | None = None) -> torch.Tensor:
    """A new flat tensor holding ``sources`` (flattened, cast to ``dtype``) back to back.

    ``offsets``: where each source starts (an aligned layout, :class:`FlatBuffer`'s
    ``align``); the gaps between sources are zero-filled.

    ``rebind``: tensors whose ``.data`` is re-pointed at their slice as soon
    as it is filled, so their old storage is released while packing goes on
    (no list of the originals is kept: the peak is the flat tensor plus the
    parameters not yet packed, about one copy).  ``via_host``: stage the
    sources through host memory first (their device storage is released
    before the flat tensor is allocated), so the device holds about one copy
    at the peak even when the caller keeps other references to the sources.
    If anything fails, every rebound tensor gets its values back in a storage
    of its own, on its device (copied out of the flat tensor or the host stage).
    """
    homes = [t.device for t in rebind] if rebind is not None else None
    packed = 0  # how many of ``rebind`` point into the flat tensor
    try:
        with torch.no_grad():
            if via_host:
                staged = [s.detach().to("cpu", copy=True) for s in sources]
                del sources
                if rebind is not None:
                    for t, s in zip(rebind, staged):
                        t.data = s.view(t.shape)  # the device storage is released here
                sources = staged
            flat = torch.empty(numel, dtype=dtype, device=device)
            offset = 0
            for i, s in enumerate(sources):
                n = s.numel()
                start = offsets[i] if offsets is not None else offset
                if start > offset:
                    flat[offset:start].zero_()  # padding of an aligned layout
                view = flat[start : start + n]
                view.copy_(s.detach().reshape(-1))
                if rebind is not None:
                    rebind[i].data = view.view(rebind[i].shape)
                    packed = i + 1
                offset = start + n
            if offset < numel:
                flat[offset:].zero_()
            return flat
    except BaseException:
        if rebind is not None:
            with torch.no_grad():
                for i, (t, home) in enumerate(zip(rebind, homes)):
                    if i < packed or t.device != home:
                        t.data = t.data.to(home, copy=True)
        raise
