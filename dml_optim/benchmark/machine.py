"""The machine a result document was measured on: platform, CPU, memory, torch; GPU, CUDA and triton on CUDA."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["describe", "load_average", "cpu_model", "vector_extensions", "cpu_summary"]

#: The vector extensions a CPU kernel's width and rounding follow, as /proc/cpuinfo names them.
_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                 "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.readlines()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what ``platform`` says)."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def vector_extensions() -> list[str]:
    """The CPU's vector extensions (of :data:`_VECTOR_FLAGS`, as /proc/cpuinfo's ``flags`` or ``Features`` line
    names them; empty where there is no such file)."""
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in _VECTOR_FLAGS if f in flags]
    return []


def cpu_summary() -> str:
    """One line naming the machine a result (a test run, a benchmark) came from: CPU model, cores, vector
    extensions and the width torch's own CPU kernels run at (``torch.backends.cpu.get_cpu_capability()``,
    which ``ATEN_CPU_CAPABILITY`` can lower)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # pragma: no cover - an older torch
        capability = "unknown"
    ext = " ".join(vector_extensions()) or "unknown"
    return f"{cpu_model()}, {os.cpu_count()} cores, vector extensions: {ext}; torch kernels: {capability}"


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
    info["cpu_model"] = cpu_model()
    info["vector_extensions"] = vector_extensions()
    try:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # pragma: no cover - an older torch
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

