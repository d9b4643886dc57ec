"""The memory row: the peak memory of building an optimizer, as a multiple of the trainable parameters' bytes.

For each model and each ``pack_via`` (``"auto"``, the default: ``"host"``
off the CPU, ``"device"`` on it; ``"device"``: copy straight into the flat
buffer; ``"host"``: stage the values through host memory first), fresh
parameters are made (no gradients yet, as before a first backward), then a
``dml_optim.Adam`` is built over them:

* **CUDA**: ``torch.cuda.reset_peak_memory_stats`` and
  ``max_memory_allocated`` around the construction;
* **CPU** (Linux): the process's resident set, its peak reset through
  ``/proc/self/clear_refs`` and read as ``VmHWM`` from ``/proc/self/status``.
  Approximate: freed blocks the C allocator keeps count as resident.
  Elsewhere: n/a with the reason.

``peak_ratio`` = (peak - memory before construction + trainable bytes) /
trainable bytes: how many copies of the trainable parameters the device held
at the peak (1.0: none beyond the parameters themselves); ``after_ratio`` the
same after construction.  Frozen parameters are held before and after, and
so are not counted.

The target for ``pack_via="auto"``: at most 1.25 on a device (CUDA stages
through host memory, so the device holds about one copy).  On the CPU the
host *is* the device: packing copies one tensor at a time and frees its old
storage right after, so the resident peak is one copy plus the largest
tensor held twice for a moment (gpt2's token embedding is 31% of the model).
There the target is ``1 + largest share + 0.05``; a regression to two full
copies (2.0) fails it.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import torch

from dml_optim.benchmark.common import free
from dml_optim.benchmark.workloads import Workload, make_params, make_values

__all__ = ["CPU_SLACK", "MEMORY_LIMIT", "PACK_MODES", "measure_memory", "memory_limit"]

#: Target: the peak at construction with ``pack_via="auto"``, in trainable parameters' bytes.
MEMORY_LIMIT = 1.25
#: On the CPU: the largest tensor's share of the trainable bytes plus this, over one copy.
CPU_SLACK = 0.05
PACK_MODES = ("auto", "device", "host")


def memory_limit(device: torch.device, largest_share: float) -> float:
    """The construction-peak target on ``device`` (see the module's docstring)."""
    if device.type != "cpu":
        return MEMORY_LIMIT
    return max(MEMORY_LIMIT, round(1.0 + largest_share + CPU_SLACK, 2))


class _Meter:
    """Bytes in use and the peak since :meth:`reset`, on one device."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            if not (os.path.exists("/proc/self/clear_refs") and os.path.exists("/proc/self/status")):
                raise RuntimeError("the CPU's peak memory is read from /proc/self (Linux only)")
        elif device.type != "cuda":
            raise RuntimeError(f"no peak-memory counter on {device.type}")

    def reset(self) -> None:
        free(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")  # resets VmHWM to the current resident set

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._status("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return self._status("VmHWM")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")


def measure_memory(work: Workload, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """One row per ``pack_via`` mode for ``work`` on ``device``."""
    from dml_optim.optimizers.registry import build

    meter = _Meter(device)
    size = torch.empty((), dtype=dtype).element_size()
    trainable = work.trainable_numel * size
    largest_share = max(math.prod(s) for i, s in enumerate(work.shapes) if work.is_trainable(i)) * size / trainable
    limit = memory_limit(device, largest_share)
    build("adam", [torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))])  # loads the code first
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    rows = []
    for mode in PACK_MODES:
        params = make_params(work, values)
        meter.reset()
        before = meter.now()
        opt = build("adam", params, pack_via=mode)
        peak, after = meter.peak(), meter.now()
        rows.append({
            "workload": work.name, "device": device.type, "pack_via": mode, "limit": limit,
            "largest_share": largest_share,
            "counter": "max_memory_allocated" if device.type == "cuda" else "VmHWM (resident set)",
            "trainable_bytes": trainable, "before_bytes": before, "peak_bytes": peak, "after_bytes": after,
            "peak_ratio": (peak - before + trainable) / trainable, "after_ratio": (after - before + trainable) / trainable,
        })
        log(f"  memory {work.name:18} pack_via={mode:6}: peak {rows[-1]['peak_ratio']:.2f}x, "
            f"after {rows[-1]['after_ratio']:.2f}x the trainable parameters' bytes")
        del opt, params
    return rows
