"""Timing: samples of a step, round-robin sampling, kernel time, and the bandwidth reference.

* **wall** (:func:`wall_seconds`): ``inner`` back-to-back calls between two
  synchronizations, divided by ``inner``; what a training loop pays.  On
  CUDA the caller asks for at least 20 back-to-back calls.
* **events** (:func:`event_seconds`, CUDA): the same calls between two CUDA
  events on the current stream (the CUDA-graph row: replays cost microseconds).
* **kernel** (:func:`kernel_seconds`, CUDA): the device time of the kernels
  (and copies) a call launches, summed from ``torch.profiler``'s CUDA events.
* :func:`round_robin`: warm-up, then samples taken in rounds whose order
  rotates; per name the median seconds per call and the spread (fastest and
  slowest sample).
* :class:`Reference`: the bandwidth ceiling measured in the same rounds: the
  in-place add ``a += s*b`` (CPU, DirectML) or ``dst.copy_(src)`` of at least
  1 GiB (CUDA).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["sync", "wall_seconds", "event_seconds", "kernel_seconds", "round_robin", "Reference", "COPY_MIN_BYTES",
           "REFERENCE_NAMES", "reference_name"]

#: The CUDA copy reference moves at least this many bytes each way.
COPY_MIN_BYTES = 1 << 30
#: Elements read + written per element by the references.  ``inplace-add`` (``a += s*b``: read a and b,
#: write a) is the CPU's: a fused optimizer step is in-place too (Adam reads x, g, m, v and writes x, m, v
#: back), so neither pays the write-allocate that makes the triad ``a = b + s*c`` move 4 elements for the
#: 3 it counts (2 vCPU EPYC, 64M float32: triad 27 GB/s, in-place add 45 GB/s, the compiled Adam step
#: 42 GB/s, i.e. 150% of the triad and 93% of the in-place add).  ``triad``: the CPU's reference before
#: 2026-11-25, kept so older result documents still read.
_REFERENCE_TRAFFIC = {"inplace-add": 3, "triad": 3, "copy": 2}
#: How a reference is named in reports and targets.
REFERENCE_NAMES = {"inplace-add": "the in-place add", "triad": "the triad", "copy": "the copy"}


def reference_name(doc) -> str:
    """How ``doc``'s (a result document's) bandwidth reference is named: from the references it recorded."""
    kinds = {r.get("reference") for r in doc.get("references", [])}
    kind = next(iter(kinds)) if len(kinds) == 1 else ("copy" if doc.get("device", "").startswith("cuda") else "inplace-add")
    return REFERENCE_NAMES.get(kind, str(kind))


#: Warm-up steps for a candidate whose first step took longer than this (seconds): one.
_SLOW_FIRST_STEP_S = 2.0


def sync(device: torch.device, probe: torch.Tensor | None = None) -> None:
    """Wait for the device's queued work (CPU: nothing to wait for; DirectML: read one element of ``probe``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and probe is not None:
        probe.reshape(-1)[:1].cpu()


def wall_seconds(fn: Callable[[], object], device: torch.device, inner: int = 1, probe: torch.Tensor | None = None) -> float:
    """Seconds per call of ``inner`` back-to-back calls, synchronized before and after."""
    sync(device, probe)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device, probe)
    return (time.perf_counter() - t0) / inner


def event_seconds(fn: Callable[[], object], inner: int = 1) -> float:
    """Seconds per call of ``inner`` calls between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def kernel_seconds(fn: Callable[[], object], steps: int) -> float:
    """Device seconds per call: the CUDA kernels, copies and fills that ``steps`` calls launch, summed.

    ``RuntimeError`` when the profiler saw no device activity (no CUPTI).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if us <= 0:
        raise RuntimeError("torch.profiler recorded no CUDA kernel (is CUPTI available?)")
    return us / 1e6 / steps


def round_robin(steps: dict[str, Callable[[], object]], timer: Callable[[Callable[[], object], int], float],
                settings: dict, first_step_s: dict[str, float] | None = None) -> dict[str, dict]:
    """Warm up each of ``steps``, pick its inner count, then sample them in rotating rounds.

    ``timer(fn, inner)`` returns seconds per call.  ``settings``: ``warmup``
    (steps; one for a step whose first took over 2 s), ``min_inner``,
    ``max_inner``, ``min_sample_s`` (the inner count makes a sample at least
    this long, within those bounds), ``rounds``, ``min_rounds`` and
    ``group_budget_s`` (rounds are cut to fit it, down to ``min_rounds``).
    Returns per name ``{"seconds": median per call, "min_seconds", "max_seconds": the fastest and the
    slowest sample (the spread), "inner": int, "samples": int}``.
    """
    if not steps:
        return {}
    first_step_s = first_step_s or {}
    for name, fn in steps.items():
        for _ in range(1 if first_step_s.get(name, 0.0) > _SLOW_FIRST_STEP_S else settings["warmup"]):
            timer(fn, 1)
    inner = {}
    for name, fn in steps.items():
        t = timer(fn, 1)
        inner[name] = max(settings["min_inner"], min(settings["max_inner"], int(settings["min_sample_s"] / max(t, 1e-9))))
    round_s = sum(timer(fn, inner[name]) * inner[name] for name, fn in steps.items())
    rounds = max(settings["min_rounds"], min(settings["rounds"], int(settings["group_budget_s"] / max(round_s, 1e-9))))
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(timer(steps[name], inner[name]))
    return {name: {"seconds": statistics.median(samples[name]), "min_seconds": min(samples[name]),
                   "max_seconds": max(samples[name]), "inner": inner[name], "samples": len(samples[name])}
            for name in names}


class Reference:
    """The bandwidth reference for ``numel`` elements: the in-place add ``a += s*b`` (CPU and others), or on
    CUDA a copy of at least 1 GiB.

    ``bytes_moved`` is what one :meth:`step` reads plus writes.
    """

    def __init__(self, numel: int, device: torch.device, dtype: torch.dtype):
        elem = torch.empty((), dtype=dtype).element_size()
        self.kind = "copy" if device.type == "cuda" else "inplace-add"
        n = max(numel, COPY_MIN_BYTES // elem) if self.kind == "copy" else numel
        if self.kind == "copy":
            self.src = torch.ones(n, device=device, dtype=dtype)
            self.dst = torch.empty_like(self.src)
            self.probe = self.dst
        else:
            gen = torch.Generator().manual_seed(1)
            self.b = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
            self.a = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
            self.probe = self.a
        self.numel = n
        self.bytes_moved = _REFERENCE_TRAFFIC[self.kind] * elem * n

    def step(self) -> None:
        if self.kind == "copy":
            self.dst.copy_(self.src)
        else:
            self.a.add_(self.b, alpha=0.5)  # grows like sqrt(steps): never near float's range
