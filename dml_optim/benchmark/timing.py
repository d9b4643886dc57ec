"""Timing: samples of a step, round-robin sampling, kernel time, and the bandwidth reference.

* **wall** (:func:`wall_seconds`): ``inner`` back-to-back calls between two
  synchronizations, divided by ``inner``; what a training loop pays.  On
  CUDA the caller asks for at least 20 back-to-back calls.
* **events** (:func:`event_seconds`, CUDA): the same calls between two CUDA
  events on the current stream (the CUDA-graph row: replays cost microseconds).
* **kernel** (:func:`kernel_seconds`, CUDA): the device time of the kernels
  (and copies) a call launches, summed from ``torch.profiler``'s CUDA events.
* :func:`round_robin`: warm-up, then samples taken in rounds whose order
  rotates; per name the median seconds per call, the spread (fastest and
  slowest sample) and the samples of each round, in order.
* :class:`Reference`: the bandwidth ceiling, its passes timed in the same
  rounds as the candidates.  Off CUDA it is **the stream limit**
  (:data:`STREAM_PASSES`): in-place streaming passes over the row's trainable
  elements, the in-place add ``a += s*b`` and, on the CPU where this torch
  runs them, ``torch._fused_sgd_`` (momentum) and ``torch._fused_adam_`` with
  ``lr=0``; a round's reference bandwidth is its fastest pass's.  On CUDA:
  ``dst.copy_(src)`` of at least 1 GiB.
* :func:`paired_fraction`: a candidate's bandwidth over the reference's, round
  by round (samples of the same round paired, so that slow periods cancel), the
  median over rounds; :func:`paired_ratio`: two candidates' times the same way,
  with the quartiles over rounds (the spread of a ratio).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["sync", "wall_seconds", "event_seconds", "kernel_seconds", "round_robin", "Reference", "COPY_MIN_BYTES",
           "STREAM_PASSES", "PASS_PREFIX", "REFERENCE_NAMES", "reference_name", "stream_pass_names", "paired_fraction",
           "paired_ratio", "rows_ratio"]

#: The CUDA copy reference moves at least this many bytes each way.
COPY_MIN_BYTES = 1 << 30
#: The passes of the stream limit (the reference off CUDA): elements read + written per element.  All are
#: in place, as a fused optimizer step is (no write-allocate): ``add`` (``a += s*b``: read a and b, write a),
#: ``sgd`` (``torch._fused_sgd_`` with momentum 0.5 and lr 0: read p, g, buf; write p, buf), ``adam``
#: (``torch._fused_adam_`` with lr 0: read p, g, m, v; write p, m, v).  The add alone is not the limit:
#: torch's hand-vectorized fused kernels stream faster than TensorIterator's add (2 vCPU EPYC, 64M float32,
#: best of 7: add 52.6 GB/s, ``_fused_sgd_`` 56.7, ``_fused_adamw_`` 57.9), so optimizer steps read
#: 104-146% of the add.
STREAM_PASSES = {"add": 3, "sgd": 5, "adam": 7}
#: Elements read + written per element by :attr:`Reference.bytes_moved`: the stream limit's is that of a
#: 3-element pass (its ``reference_ms`` is such a pass at the limit's bandwidth).  The CPU's earlier
#: references, kept so older result documents still read: ``inplace-add`` (the add alone, documents up to
#: 2026-11-27) and ``triad`` (``a = b + s*c``, before 2026-11-25: it pays a write-allocate, 4 elements moved
#: for the 3 it counts).
_REFERENCE_TRAFFIC = {"stream": 3, "inplace-add": 3, "triad": 3, "copy": 2}
#: How a reference is named in reports and targets.
REFERENCE_NAMES = {"stream": "the stream limit", "inplace-add": "the in-place add", "triad": "the triad",
                   "copy": "the copy"}


def reference_name(doc) -> str:
    """How ``doc``'s (a result document's) bandwidth reference is named: from the references it recorded."""
    kinds = {r.get("reference") for r in doc.get("references", [])}
    kind = next(iter(kinds)) if len(kinds) == 1 else ("copy" if doc.get("device", "").startswith("cuda") else "stream")
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
    slowest sample (the spread), "inner": int, "samples": int, "round_seconds": the sample of each round,
    in order}``: every name has one sample per round, so ``round_seconds[r]`` of two names were taken in
    the same round.
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
                   "max_seconds": max(samples[name]), "inner": inner[name], "samples": len(samples[name]),
                   "round_seconds": samples[name]}
            for name in names}


def paired_fraction(seconds: Sequence[float], step_bytes: float, reference_bps: Sequence[float]) -> float:
    """The median over rounds of (``step_bytes / seconds[r]``) / ``reference_bps[r]``: a candidate's bandwidth
    as a fraction of the reference's bandwidth in the same round (``reference_bps``: bytes per second)."""
    if len(seconds) != len(reference_bps) or not seconds:
        raise ValueError(f"{len(seconds)} samples paired with {len(reference_bps)} reference rounds")
    return statistics.median(step_bytes / s / bps for s, bps in zip(seconds, reference_bps))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, float, float]:
    """``(median, first quartile, third quartile)`` over rounds of ``numerator[r] / denominator[r]``: two
    candidates' times taken in the same rounds (:func:`round_robin`'s ``round_seconds``), compared round by round.

    On a shared machine a slow period (a neighbour's job, a frequency change) slows every candidate of its round;
    the ratio of two medians taken apart mixes such rounds of one candidate with quiet rounds of the other, the
    ratio within a round does not.  The quartiles are the spread: where they straddle 1.0 the two are a tie
    at this run's noise."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"{len(numerator)} samples paired with {len(denominator)}")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def rows_ratio(numerator: dict, denominator: dict) -> tuple[float, list[float] | None]:
    """``numerator``'s time over ``denominator``'s, two rows of the same round-robin (``ms_per_step``, and
    ``round_ms``: each round's sample), and the spread ``[first quartile, third quartile]``: round by round
    (:func:`paired_ratio`) where both rows recorded their rounds; the ratio of the medians, spread None, in
    documents recorded before ``round_ms``."""
    a, b = numerator.get("round_ms"), denominator.get("round_ms")
    if a and b and len(a) == len(b):
        median, q1, q3 = paired_ratio(a, b)
        return median, [q1, q3]
    return numerator["ms_per_step"] / denominator["ms_per_step"], None


#: The prefix of a reference pass's name among the steps :func:`round_robin` times (``"reference add"``).
PASS_PREFIX = "reference "


def _shared(shared: dict[str, torch.Tensor], name: str, like: torch.Tensor, fill: float) -> torch.Tensor:
    """``shared[name]``, made (``like`` filled with ``fill``) the first time a pass asks for it."""
    if name not in shared:
        shared[name] = torch.full_like(like, fill)
    return shared[name]


def _add_pass(p: torch.Tensor, g: torch.Tensor, shared: dict[str, torch.Tensor]) -> Callable[[], object]:
    """``p += g/2``: p grows by g/2 a call, never near float's range in a run."""
    return lambda: p.add_(g, alpha=0.5)


def _sgd_pass(p: torch.Tensor, g: torch.Tensor, shared: dict[str, torch.Tensor]) -> Callable[[], object]:
    """``torch._fused_sgd_`` with momentum 0.5 and lr 0: the buffer tends to 2g, p stays."""
    buf = _shared(shared, "m", p, 0.0)
    return lambda: torch._fused_sgd_([p], [g], [buf], weight_decay=0.0, momentum=0.5, lr=0.0, dampening=0.0,
                                     nesterov=False, maximize=False, is_first_step=False)


def _adam_pass(p: torch.Tensor, g: torch.Tensor, shared: dict[str, torch.Tensor]) -> Callable[[], object]:
    """``torch._fused_adam_`` with lr 0 at step 1 (no division by a zero bias correction): m tends to g, v to
    g squared, p stays."""
    m, v = _shared(shared, "m", p, 0.0), _shared(shared, "v", p, 1.0)
    step = torch.ones((), dtype=torch.float32, device=p.device)
    return lambda: torch._fused_adam_([p], [g], [m], [v], [], [step], lr=0.0, beta1=0.9, beta2=0.999,
                                      weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


#: How each of :data:`STREAM_PASSES` is built over p, g and ``shared`` (the passes' tensors by name: a pass
#: adds the ``m`` or ``v`` it needs, or takes the one there).
_PASS_BUILDERS = {"add": _add_pass, "sgd": _sgd_pass, "adam": _adam_pass}


def _runs(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the stream pass ``name`` runs here: built over a few elements and called once (the fused ops
    are missing before torch 2.4, and run only on some devices and dtypes)."""
    try:
        _PASS_BUILDERS[name](torch.ones(8, device=device, dtype=dtype), torch.ones(8, device=device, dtype=dtype), {})()
        return True
    except Exception:  # AttributeError (no such op), RuntimeError / NotImplementedError (not for this device, dtype)
        return False


def stream_pass_names(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The passes of the stream limit on ``device``: the add, and on the CPU the fused SGD and Adam passes
    where they run (torch >= 2.4)."""
    fused = [n for n in STREAM_PASSES if n != "add"] if device.type == "cpu" else []
    return ["add"] + [n for n in fused if _runs(n, device, dtype)]


class Reference:
    """The bandwidth reference for ``numel`` elements: its passes (:attr:`passes`, each one in-place call),
    timed in the candidates' rounds (:meth:`steps`); a round's reference bandwidth is its fastest pass's
    (:meth:`summary`).

    Off CUDA (kind ``stream``, "the stream limit"): :func:`stream_pass_names` over ``numel`` elements.  The
    passes share their tensors (:attr:`tensors`: ``p`` and ``g``, and ``m`` and ``v`` where a fused pass runs;
    SGD's momentum buffer is Adam's m): at most four of ``numel`` elements.  On CUDA (kind ``copy``):
    ``dst.copy_(src)`` of at least :data:`COPY_MIN_BYTES`, its one pass.  ``traffic``: elements read + written
    per element, per pass; ``bytes_moved``: the bytes of a 3-element pass (``stream``) or of the copy.
    """

    def __init__(self, numel: int, device: torch.device, dtype: torch.dtype):
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.kind = "copy" if device.type == "cuda" else "stream"
        if self.kind == "copy":
            self.numel = max(numel, COPY_MIN_BYTES // self.elem)
            src = torch.ones(self.numel, device=device, dtype=dtype)
            self.probe = torch.empty_like(src)
            self.passes: dict[str, Callable[[], object]] = {"copy": lambda: self.probe.copy_(src)}
            self.traffic = {"copy": _REFERENCE_TRAFFIC["copy"]}
        else:
            self.numel = numel
            gen = torch.Generator().manual_seed(1)
            g = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)
            self.probe = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)  # p: every pass writes it
            self.tensors = {"p": self.probe, "g": g}
            self.passes = {n: _PASS_BUILDERS[n](self.probe, g, self.tensors) for n in stream_pass_names(device, dtype)}
            self.traffic = {n: STREAM_PASSES[n] for n in self.passes}
        self.bytes_moved = _REFERENCE_TRAFFIC[self.kind] * self.elem * self.numel

    def steps(self) -> dict[str, Callable[[], object]]:
        """The passes as steps for :func:`round_robin`, named ``"reference <pass>"``."""
        return {PASS_PREFIX + name: fn for name, fn in self.passes.items()}

    def pass_bytes(self, name: str) -> int:
        """The bytes one call of pass ``name`` reads plus writes."""
        return self.traffic[name] * self.elem * self.numel

    def rates(self, timed: dict[str, dict]) -> dict[str, list[float]]:
        """Per pass, its bytes per second in each round (``timed``: :func:`round_robin`'s result, with
        :meth:`steps` among its steps)."""
        return {name: [self.pass_bytes(name) / s for s in timed[PASS_PREFIX + name]["round_seconds"]]
                for name in self.passes}

    def summary(self, timed: dict[str, dict]) -> tuple[list[float], dict]:
        """The reference bandwidth of each round (bytes per second: the fastest pass's), and the record's fields:
        ``reference_gbs`` (the median of those), ``reference_ms`` (:attr:`bytes_moved` at that bandwidth),
        ``reference_passes`` (per pass: ``traffic``, its median ``gbs``, ``fastest_rounds``: the rounds it was
        the fastest in) and ``reference_fastest`` (the pass fastest in most rounds; a tie: the higher median)."""
        rates = self.rates(timed)
        names = list(rates)
        rounds = list(zip(*rates.values()))  # per round, each pass's bytes per second
        best = [max(r) for r in rounds]
        wins = [names[r.index(max(r))] for r in rounds]
        passes = {n: {"traffic": self.traffic[n], "fastest_rounds": wins.count(n),
                      "gbs": self.pass_bytes(n) / timed[PASS_PREFIX + n]["seconds"] / 1e9} for n in names}
        bps = statistics.median(best)
        return best, {"reference_ms": self.bytes_moved / bps * 1e3, "reference_gbs": bps / 1e9,
                      "reference_passes": passes,
                      "reference_fastest": max(names, key=lambda n: (passes[n]["fastest_rounds"], passes[n]["gbs"]))}
