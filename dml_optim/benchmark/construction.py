"""The construction row: building an optimizer and taking its first step, dml_optim's defaults beside torch fused.

The model is 16 x ``Linear(512, 512)`` (``--quick``: ``Linear(64, 64)``),
4,202,496 elements, all trainable.  Each repetition makes fresh parameters
with gradients (copies of the same values; not timed, as creating a model
is not), then times the optimizer's construction and its first step, each
followed by a synchronization: ``dml_optim auto``
(``registry.build(name, params)``: the defaults, so ``backend="auto"``,
which runs torch's fused kernel on the flat buffer on the CPU, nothing to
compile, and compiles a buffer this size on CUDA) and ``torch fused``
(``fused=True``), with the registry's hyperparameters.  What ``auto`` ran is
read from the optimizer after its first step
(:func:`~dml_optim.benchmark.candidates.ran`): the row's ``backend`` and the
record's ``auto_backend`` (``fused``, ``eager``, ``compiled``); where
``dml_optim auto`` is n/a, the record says what it would run
(:func:`~dml_optim.benchmark.candidates.auto_backend`).

The first repetition of each candidate is recorded on its own (``cold_s``):
where the rule was to compile and was never compiled in this process it
includes the compile (seconds; well under one from inductor's disk cache,
and more for the first compile of the process, which starts inductor).
Then ``repetitions`` warm ones (any kernel compiled, a fresh optimizer over
fresh parameters each time), the order alternating, and the medians: ``ms``
(construction + first step), ``construct_ms``, ``first_step_ms``, with
``ms_min`` and ``ms_max`` (the spread).  ``ratio`` = dml_optim's ``ms`` over
torch fused's; the target is at most :data:`LIMIT`.  A compile fallback
makes dml_optim n/a with the reason (it would time the eager backend
instead).

Run it first among the rows that compile (``run.py`` does), or ``cold_s`` is
not cold where ``auto`` compiles.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch

from dml_optim.benchmark.candidates import AUTO, auto_backend, build_optimizer, no_compile_fallback, ran
from dml_optim.benchmark.common import error_text, young_garbage_only
from dml_optim.benchmark.timing import sync
from dml_optim.benchmark.workloads import Workload, linears, make_params, make_values

__all__ = ["CANDIDATES", "LIMIT", "REPETITIONS", "ROW_FIELDS", "workload", "blank_row", "make_record",
           "measure_construction"]

CANDIDATES = (AUTO, "torch fused")
#: Target: dml_optim's construction + first step costs at most this many times torch fused's (warm medians).
LIMIT = 1.5
#: Warm repetitions per candidate (``--quick``: 3).
REPETITIONS = 7
_QUICK_REPETITIONS = 3
#: The fields of every candidate's row (None where not measured).
ROW_FIELDS = ("candidate", "available", "reason", "backend", "cold_s", "ms", "ms_min", "ms_max", "construct_ms",
              "first_step_ms", "samples")


def workload(*, quick: bool) -> Workload:
    """The row's model: 16 x ``Linear(512, 512)`` (``quick``: 64 wide)."""
    return linears(d=64 if quick else 512)


def _once(name: str, optimizer: str, work: Workload, values: list, grads: list, device: torch.device,
          ran_in: dict[str, str | None] | None = None) -> tuple[float, float]:
    """One repetition: fresh parameters with gradients (not timed), then the seconds of the construction and of
    the first step; ``ran_in[name]``: what a dml_optim optimizer's buffers ran (not timed)."""
    params = make_params(work, values)
    for p, g in zip(params, grads):
        p.grad = g.clone()  # a fresh gradient, as autograd's: dml_optim copies it into its flat buffer
    sync(device, params[-1])
    with no_compile_fallback():
        t0 = time.perf_counter()
        opt = build_optimizer(name, optimizer, params)
        sync(device, params[-1])
        t1 = time.perf_counter()
        opt.step()
        sync(device, params[-1])
        t2 = time.perf_counter()
    if ran_in is not None and name.startswith("dml_optim"):
        ran_in[name] = ran(opt)
    del opt, params
    gc.collect()  # not timed: the next repetition starts without this one's garbage (young_garbage_only: cheap)
    return t1 - t0, t2 - t1


def blank_row(name: str) -> dict[str, Any]:
    """A candidate's row before it is measured (n/a until then)."""
    row = dict.fromkeys(ROW_FIELDS)
    row.update(candidate=name, available=False)
    return row


def make_record(optimizer: str, work: Workload, auto: str, rows: list[dict]) -> dict[str, Any]:
    """The row's record from its candidates' ``rows``: the model, the limit, and the target's ratio
    (dml_optim's warm median over torch fused's)."""
    ms = {r["candidate"]: r["ms"] for r in rows}
    ours, fused = ms.get(AUTO), ms.get("torch fused")
    return {"optimizer": optimizer, "workload": work.name, "tensors": len(work.shapes), "elements": work.trainable_numel,
            "auto_backend": auto, "limit": LIMIT, "ratio": None if ours is None or fused is None else ours / fused,
            "rows": rows}


def _sample(optimizer: str, work: Workload, values: list, grads: list, device: torch.device, rows: dict[str, dict],
            repetitions: int, log: Callable[[str], None]) -> dict[str, list[tuple[float, float]]]:
    """Each candidate's cold repetition (its ``cold_s`` in ``rows``; a failure makes it n/a), then
    ``repetitions`` warm ones, the order alternating: per candidate that runs, the (construction, first step)
    seconds of each warm one."""
    times: dict[str, list[tuple[float, float]]] = {}
    backends: dict[str, str | None] = {}
    for name, row in rows.items():
        try:
            row["cold_s"] = sum(_once(name, optimizer, work, values, grads, device, backends))
            row["backend"] = backends.get(name)
            times[name] = []
            row["available"] = True
        except Exception as exc:  # torch refuses fused here, the compile failed, ...
            row["reason"] = error_text(exc)
            log(f"  {optimizer:8} construction {name:16} n/a ({row['reason']})")
    names = list(times)
    for r in range(repetitions) if names else ():
        k = r % len(names)  # the order alternates: each goes first as often
        for name in names[k:] + names[:k]:
            times[name].append(_once(name, optimizer, work, values, grads, device))
    return times


def measure_construction(optimizer: str, device: torch.device, dtype: torch.dtype, log: Callable[[str], None], *,
                         quick: bool) -> dict[str, Any]:
    """The construction row of ``optimizer``: its record (see the module docstring)."""
    work = workload(quick=quick)
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    grads = make_values(work, device, dtype, seed=7, scale=1e-2)
    rows = {name: blank_row(name) for name in CANDIDATES}
    with young_garbage_only():
        times = _sample(optimizer, work, values, grads, device, rows, _QUICK_REPETITIONS if quick else REPETITIONS, log)
    for name, samples in times.items():
        total = [a + b for a, b in samples]
        rows[name].update(ms=statistics.median(total) * 1e3, ms_min=min(total) * 1e3, ms_max=max(total) * 1e3,
                          construct_ms=statistics.median(a for a, _ in samples) * 1e3,
                          first_step_ms=statistics.median(b for _, b in samples) * 1e3, samples=len(samples))
    auto = rows[AUTO]["backend"] or auto_backend(optimizer, device, dtype, work.trainable_numel)
    record = make_record(optimizer, work, auto, list(rows.values()))
    log(f"  {optimizer:8} construction + first step on {work.name}: " + ", ".join(
        f"{r['candidate']} {_ms(r['ms'])} (cold {_s(r['cold_s'])})" for r in record["rows"]))
    return record


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"
