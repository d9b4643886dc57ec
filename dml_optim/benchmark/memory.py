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
so are not counted.  The target for ``pack_via="auto"`` is at most 1.25.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from dml_optim.benchmark.common import free
from dml_optim.benchmark.workloads import Workload, make_params, make_values

__all__ = ["MEMORY_LIMIT", "PACK_MODES", "measure_memory"]

#: Target: the peak at construction with ``pack_via="auto"``, in trainable parameters' bytes.
MEMORY_LIMIT = 1.25
PACK_MODES = ("auto", "device", "host")


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
    trainable = work.trainable_numel * torch.empty((), dtype=dtype).element_size()
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
            "workload": work.name, "device": device.type, "pack_via": mode, "limit": MEMORY_LIMIT,
            "counter": "max_memory_allocated" if device.type == "cuda" else "VmHWM (resident set)",
            "trainable_bytes": trainable, "before_bytes": before, "peak_bytes": peak, "after_bytes": after,
            "peak_ratio": (peak - before + trainable) / trainable, "after_ratio": (after - before + trainable) / trainable,
        })
        log(f"  memory {work.name:18} pack_via={mode:6}: peak {rows[-1]['peak_ratio']:.2f}x, "
            f"after {rows[-1]['after_ratio']:.2f}x the trainable parameters' bytes")
        del opt, params
    return rows
