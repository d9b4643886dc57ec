"""The machine a result document was measured on: platform, CPU, memory, torch; GPU, CUDA and triton on CUDA."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["describe", "load_average"]


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def describe(device: torch.device) -> dict[str, Any]:
    """What the document's ``machine`` holds (``loadavg_end`` is added when the run ends)."""
    import dml_optim

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dml_optim": dml_optim.__version__,
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    load = load_average()
    if load is not None:
        info["loadavg_start"] = load
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info
