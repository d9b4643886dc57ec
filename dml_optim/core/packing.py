"""Parameters and their values on their way into a flat buffer: distributed tensors, and packing.

* :func:`is_distributed`, :func:`local_tensor`: a ``DTensor`` (FSDP2,
  tensor parallel) and the shard this rank holds;
* :func:`group_key`, :func:`describe_param`: how parameters are grouped into
  buffers and named in errors;
* :func:`pack_values`: many tensors copied into one new flat tensor with a
  bounded memory peak (each source re-pointed at its slice as soon as it is
  filled), optionally staged through host memory, and undone on failure;
* :func:`contiguous_strides`: the strides of a packed (row-major) shape;
* :func:`storage_less`, :func:`storage_less_device`, :func:`address`, :func:`flat_tensor`: tensors without
  storage (DirectML's: ``data_ptr()`` and ``untyped_storage()`` raise), and where a tensor lies.

**Devices without storage.**  torch-directml's tensors are opaque: views share memory through their metadata
(sizes, strides, ``storage_offset()``), and nothing tells two tensors' memory apart.  Where a tensor lies is
then its storage offset, in elements (:func:`address`), and every flat parameter or gradient tensor on such a
device starts an offset of its own into a tensor of its own (:func:`flat_tensor`: a multiple of
:data:`OPAQUE_PAD`, a different one for each tensor made, up to 4,096 of them): a parameter or gradient view
of a flat buffer never sits at offset 0, where every freshly allocated tensor sits, nor where another flat
buffer's views sit, so a parameter re-bound to a new tensor (``p.data = t``, ``model.half()``) or to
another buffer's parameter shows as another address, as it does through its data pointer on the CPU.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Sequence

import torch

__all__ = ["is_distributed", "local_tensor", "group_key", "describe_param", "pack_values", "contiguous_strides",
           "storage_less", "storage_less_device", "address", "flat_tensor", "OPAQUE_PAD"]

_HAS_STORAGE = torch._C._has_storage
#: On a device without storage, a flat parameter or gradient tensor starts a multiple of this many elements into a
#: tensor of its own (64 bytes of float32: aligned as the allocation is), so that none of its views sits at offset 0
#: or where another flat tensor's views sit (:func:`flat_tensor`).
OPAQUE_PAD = 16
_PADS = itertools.count()
_STORAGE_LESS: dict[str, bool] = {"cpu": False, "cuda": False, "meta": False}


def storage_less(t: torch.Tensor) -> bool:
    """``t`` has no storage (a DirectML tensor): its ``data_ptr()`` and ``untyped_storage()`` raise."""
    return not _HAS_STORAGE(t)


def storage_less_device(device) -> bool:
    """Tensors on ``device`` have no storage (DirectML's, the stand-in's); probed once per device type."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    found = _STORAGE_LESS.get(kind)
    if found is None:
        found = _STORAGE_LESS[kind] = not _HAS_STORAGE(torch.empty(0, device=device))
    return found


def address(t: torch.Tensor, opaque: bool) -> int:
    """Where ``t``'s first element lies: its data pointer (bytes), or on a device without storage (``opaque``)
    its storage offset (elements; see the module docstring)."""
    return t.storage_offset() if opaque else t.data_ptr()


def flat_tensor(numel: int, dtype: torch.dtype, device, *, zero: bool) -> torch.Tensor:
    """A new flat tensor of ``numel`` elements (zeros, or uninitialized): on a device without storage, a view at an
    offset of its own into a tensor of its own (see the module docstring)."""
    alloc = torch.zeros if zero else torch.empty
    if not storage_less_device(device):
        return alloc(numel, dtype=dtype, device=device)
    pad = OPAQUE_PAD * (1 + next(_PADS) % 4096)  # (at most 256 KiB of float32 ahead of the buffer)
    return alloc(pad + numel, dtype=dtype, device=device)[pad:]


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
#: The device types ``p.data = t`` may move a tensor between (torch's ``has_compatible_shallow_copy_type``).
_DENSE = frozenset({"cpu", "cuda", "mps", "hip", "xpu", "hpu"})


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
    staged = None
    try:
        with torch.no_grad():
            if via_host:
                staged = [s.detach().to("cpu", copy=True) for s in sources]
                del sources
                if rebind is not None:
                    # the device memory is released here: the tensors point at their host copies, or, where torch
                    # refuses a tensor of another device type (a PrivateUse1 device such as DirectML: ``set_data``
                    # takes the dense backends only), at an empty tensor of their own device until they are packed
                    for t, s in zip(rebind, staged):
                        t.data = (s.view(t.shape) if t.device.type in _DENSE
                                  else torch.empty(0, dtype=t.dtype, device=t.device))
                sources = staged
            flat = flat_tensor(numel, dtype, device, zero=False)
            offset = 0
            for i, s in enumerate(sources):
                n = s.numel()
                start = offsets[i] if offsets is not None else offset
                if start > offset:
                    flat[offset:start].zero_()  # padding of an aligned layout
                view = flat[start : start + n]
                view.copy_(s.detach().reshape(-1))
                if rebind is not None:
                    rebind[i].data = view.view(s.shape)  # (s: the source, or its host copy when parked)
                    packed = i + 1
                offset = start + n
            if offset < numel:
                flat[offset:].zero_()
            return flat
    except BaseException:
        if rebind is not None:
            with torch.no_grad():
                for i, (t, home) in enumerate(zip(rebind, homes)):
                    if i >= packed and staged is not None and t.shape != staged[i].shape:
                        t.data = staged[i].to(home, copy=True).view(staged[i].shape)  # (parked on an empty tensor)
                    elif i < packed or t.device != home:
                        t.data = t.data.to(home, copy=True)
        raise
