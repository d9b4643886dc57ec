"""Running the benchmark: a plan of measurements, each in its own try/except, the document written as it goes.

:func:`make_plan` checks the arguments (``ValueError`` naming the value) and
lists the measurements of the selected rows, in this order: ``memory``,
``construction`` (before any row that compiles, so that its cold first
construction pays the compile), ``graph``, ``instances``, ``frozen``,
``host``, ``nonepattern``, ``lowbit``, ``speed`` (the cheap rows first, so
that ``--budget`` cuts the long speed grid, not them), then ``wholemem`` (the
whole-training peak, a subprocess per configuration: measured when named).  What the
run leaves out is listed with the reason (:func:`not_measured`): a row the
device cannot run (``graph`` off CUDA; ``instances`` without the compiled
backend), one not selected, and off CUDA the CUDA-only parts of the speed
rows (kernel time, the copy reference: the stream limit stands for it).
:func:`run_plan` runs them one at a time: a failure is recorded in
``errors`` and the run goes on; memory is freed after each; with a budget,
measurements that would start after it are recorded in ``skipped``; after
each, the targets are re-checked and stored beside their measurements
(:func:`~dml_optim.benchmark.targets.record_targets`), and ``checkpoint(doc)`` is called (the
command writes the JSON there), so an interrupted run leaves what it measured.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dml_optim.benchmark import construction, frozen, graphs, host, loops, lowbit, memory, nonepattern, speed
from dml_optim.benchmark.candidates import CANDIDATES, OPTIMIZERS
from dml_optim.benchmark.common import error_text, free
from dml_optim.benchmark.machine import describe, load_average
from dml_optim.benchmark.targets import record_targets
from dml_optim.benchmark.workloads import QUICK_WORKLOADS, Workload, default_workloads, lora, workload

__all__ = ["ROWS", "SCHEMA", "default_rows", "unmeasurable", "not_measured", "settings_for", "Task", "Plan", "make_plan",
           "new_document", "run_plan"]

#: The rows, in the order a run measures them.
ROWS = ("memory", "construction", "graph", "instances", "frozen", "host", "nonepattern", "loops", "lowbit", "speed",
        "wholemem")
#: Version of the result document's layout (``bench/README.md``).
SCHEMA = 2
_DEFAULT_ROWS = {"cpu": ("memory", "construction", "instances", "frozen", "host", "nonepattern", "loops", "lowbit",
                         "speed"),
                 "cuda": ("memory", "construction", "graph", "instances", "frozen", "nonepattern", "lowbit", "speed")}


def default_rows(device_type: str) -> tuple[str, ...]:
    """The rows measured when none are named: the CPU leaves out ``graph`` (CUDA only), CUDA leaves out
    ``host`` (this CPU's host work, measured by a CPU run); DirectML measures the speed and frozen rows."""
    return _DEFAULT_ROWS.get(device_type, ("frozen", "speed"))


def unmeasurable(row: str, device: torch.device) -> str | None:
    """Why ``row`` cannot be measured on ``device`` (None: it can)."""
    if row == "graph" and device.type != "cuda":
        return f"CUDA only: a step captured in torch.cuda.graph and replayed; the device is {device.type}"
    if row == "loops" and device.type != "cpu":
        return (f"measured by a CPU run (torch's fused CPU step beside ours; DirectML's path as the eager backend's "
                f"host time); the device is {device.type}")
    if row == "wholemem" and device.type not in ("cpu", "cuda"):
        return (f"CPU or CUDA only: the peak is the resident set (CPU) or max_memory_allocated (CUDA); the device is "
                f"{device.type}")
    if row == "instances":
        from dml_optim.backends.compiled import compile_available

        ok, why = compile_available(device.type)
        return None if ok else f"needs the compiled backend: {why}"
    return None


#: Why a row that can run is left out when ``--rows`` does not name it.
_NOT_SELECTED = {"host": "measured by a CPU run (the CPU's steps with the default backend and the eager one, one "
                         "thread); `--rows host` adds it to any run",
                 "wholemem": "the whole-training peak, a subprocess per configuration and zero_grad style (minutes "
                             "on a 50M-parameter model); `--rows wholemem` adds it to any run"}


def not_measured(device: torch.device, requested: Sequence[str]) -> list[dict[str, str]]:
    """What a run of rows ``requested`` on ``device`` leaves out: ``{"what", "reason"}`` per row the device
    cannot run or ``--rows`` did not name, and off CUDA the speed rows' CUDA-only figures."""
    out = []
    for row in ROWS:
        why = unmeasurable(row, device)
        if why is None and row not in requested:
            why = _NOT_SELECTED.get(row) if row not in default_rows(device.type) else None
            why = why or "not selected (--rows)"
        if why is not None:
            out.append({"what": row, "reason": why})
    if device.type != "cuda" and {"speed", "frozen"} & set(requested):
        out.append({"what": "kernel time", "reason": "CUDA only: the device time of a step's kernels, from "
                    f"torch.profiler's CUDA activity; on {device.type} the wall time is all there is"})
        out.append({"what": "copy bandwidth", "reason": "CUDA only: a 1 GiB device-to-device copy_; the reference "
                    f"on {device.type} is the stream limit: the fastest, round by round, of in-place passes over the "
                    "workload's trainable elements (add_, and on the CPU torch._fused_sgd_ and torch._fused_adam_ "
                    "with lr=0)"})
    return out


def settings_for(device_type: str, quick: bool) -> dict[str, Any]:
    """Sampling settings (:func:`dml_optim.benchmark.timing.round_robin`); CUDA: 3 warm-up steps and
    at least 20 back-to-back steps per sample; ``kernel_time``: profile kernels (CUDA); ``settle``: step
    ``dml_optim auto`` candidates until ``auto`` has decided (:func:`~dml_optim.benchmark.candidates.settle`)."""
    s = dict(warmup=2, rounds=9, min_rounds=3, min_inner=1, max_inner=50, min_sample_s=0.02, group_budget_s=60.0,
             kernel_time=True, settle=True)
    if device_type == "cuda":
        s.update(warmup=3, rounds=11, min_rounds=5, min_inner=20, max_inner=200, min_sample_s=0.01, group_budget_s=6.0)
    if quick:
        s.update(warmup=min(s["warmup"], 3 if device_type == "cuda" else 1), rounds=3, min_rounds=3,
                 min_sample_s=0.002, group_budget_s=2.0, settle=False)  # (no 5 s of eager steps per row)
    return s


Log = Callable[[str], None]


@dataclass
class Task:
    """One measurement: ``row`` (one of :data:`ROWS`), what it measures, and ``run(doc, log)``, which
    measures and records into the document."""

    row: str
    label: str
    run: Callable[[dict, Log], None]


@dataclass
class Plan:
    """What a run will measure, and how."""

    device: torch.device
    quick: bool
    rows: tuple[str, ...]
    optimizers: tuple[str, ...]
    workloads: tuple[Workload, ...]
    dtype: torch.dtype
    budget_s: float | None
    settings: dict[str, Any]
    tasks: list[Task] = field(default_factory=list)
    not_measured: list[dict[str, str]] = field(default_factory=list)


def make_plan(*, device: str = "cpu", quick: bool = False, rows: Sequence[str] | None = None,
              optimizers: Sequence[str] | None = None, workloads: Sequence[str] | None = None,
              dtype: torch.dtype = torch.float32, budget_s: float | None = None) -> Plan:
    """The measurements of a run.

    ``ValueError`` when an argument is unusable; its message starts with the
    argument's name (``"workloads: unknown model 'x': ..."``).
    """
    from dml_optim.job.train import resolve_device

    try:
        dev = resolve_device(device)
    except ValueError as exc:
        raise ValueError(f"device: {exc}") from None
    requested = tuple(rows or default_rows(dev.type))
    for r in requested:
        if r not in ROWS:
            raise ValueError(f"rows: {r!r} is not a row (rows: {', '.join(ROWS)})")
    optimizers = tuple(optimizers or OPTIMIZERS)
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"optimizers: {o!r} is unknown (known: {', '.join(OPTIMIZERS)})")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget: must be a positive number of seconds, got {budget_s!r}")
    try:
        works = tuple(workload(w) for w in (workloads or (QUICK_WORKLOADS if quick else default_workloads(dev.type))))
    except ValueError as exc:
        raise ValueError(f"workloads: {exc}") from None
    plan = Plan(dev, quick, tuple(r for r in ROWS if r in requested and unmeasurable(r, dev) is None), optimizers,
                works, dtype, budget_s, settings_for(dev.type, quick))
    plan.tasks = _tasks(plan)
    plan.not_measured = not_measured(dev, requested)
    return plan


def _memory_workloads(device: torch.device, quick: bool) -> list[Workload]:
    """gpt2's shapes and the LoRA model; on the CPU gpt2 alone: the resident set cannot resolve the LoRA
    model's 0.5 MB (the C allocator keeps freed small blocks)."""
    works = [workload("resnet50" if quick else "gpt2")]
    return works + ([lora(d=64 if quick else 512)] if device.type == "cuda" else [])


def _record_speed(doc: dict, rows: list[dict], refs: list[dict]) -> None:
    doc["results"].extend(rows)
    doc["references"].extend(refs)


def _tasks(plan: Plan) -> list[Task]:
    dev, dtype, s, quick = plan.device, plan.dtype, plan.settings, plan.quick
    tasks: list[Task] = []
    if "memory" in plan.rows:
        for work in _memory_workloads(dev, quick):
            tasks.append(Task("memory", f"memory: construction on {work.name}", lambda doc, log, w=work:
                              doc["memory"].extend(memory.measure_memory(w, dev, dtype, log))))
    if "construction" in plan.rows:
        name = construction.workload(quick=quick).name
        for o in plan.optimizers:
            tasks.append(Task("construction", f"construction: {o} on {name}, construction + first step vs torch fused",
                              lambda doc, log, o=o: doc["construction"].append(
                                  construction.measure_construction(o, dev, dtype, log, quick=quick))))
    if "graph" in plan.rows:
        tasks.append(Task("graph", "graph: many-small Adam, capturable, in a CUDA graph", lambda doc, log:
                          doc["graphs"].append(graphs.measure_graphs(dev, dtype, s, log, quick=quick))))
    if "instances" in plan.rows:
        tasks.append(Task("instances", "instances: 12 compiled Adam, the 12th vs the 2nd", lambda doc, log:
                          doc["instances"].append(host.measure_instances(dev, dtype, s, log, quick=quick))))
    if "frozen" in plan.rows:
        for o in plan.optimizers:
            tasks.append(Task("frozen", f"frozen: {o} on the LoRA model", lambda doc, log, o=o:
                              _record_speed(doc, *_listed(frozen.measure_lora(o, dev, dtype, s, log, quick=quick)))))
            tasks.append(Task("frozen", f"frozen: {o}, gradual unfreezing", lambda doc, log, o=o:
                              _record_speed(doc, *frozen.measure_unfreezing(o, dev, dtype, s, log, quick=quick))))
    if "host" in plan.rows:
        cpu_settings = settings_for("cpu", quick)
        for o in plan.optimizers:
            tasks.append(Task("host", f"host work: {o}, 2000x16 vs 1x32000 (cpu, 1 thread)", lambda doc, log, o=o:
                              doc["host_work"].append(host.measure_host_work(o, cpu_settings, log))))
    if "loops" in plan.rows:
        for model in loops.MODELS:
            tasks.append(Task("loops", f"loops: AdamW on {model}, plain / LambdaLR / set_to_none + LambdaLR vs torch fused",
                              lambda doc, log, m=model: doc["loops"].extend(loops.measure_loops(m, s, log, quick=quick))))
        eager_s = {**s, "min_inner": 20, "max_inner": 5000}
        tasks.append(Task("loops", "loops: DirectML's path (eager, host time per step) vs torch's for-loop AdamW",
                          lambda doc, log: doc["loops_eager"].append(loops.measure_eager_loops(eager_s, log, quick=quick, loop_settings=s))))
    if "nonepattern" in plan.rows:
        name = nonepattern.workload(quick=quick).name
        for o in plan.optimizers:
            tasks.append(Task("nonepattern", f"nonepattern: {o} on {name}, None gradients changing every step",
                              lambda doc, log, o=o: doc["nonepattern"].append(
                                  nonepattern.measure_nonepattern(o, dev, dtype, s, log, quick=quick))))
    if "lowbit" in plan.rows:
        tasks.append(Task("lowbit", "low-bit: AdamW 8-bit and 4-bit beside torch fused and the peers", lambda doc, log:
                          doc["lowbit"].append(lowbit.measure_lowbit(dev, dtype, s, log, quick=quick))))
    if "speed" in plan.rows:
        for work in plan.workloads:
            for o in plan.optimizers:
                tasks.append(Task("speed", f"speed: {o} on {work.name}", lambda doc, log, o=o, w=work:
                                  _record_speed(doc, *_listed(speed.measure_group(o, w, dev, dtype, s, log)))))
    if "wholemem" in plan.rows:  # (imported here: its child runs `python -m dml_optim.benchmark.wholemem`, which
        from dml_optim.benchmark import wholemem  # must not find it imported already by the package)

        tasks += wholemem.bench_tasks(plan, Task)
    return tasks


def _listed(result: tuple[list[dict], dict]) -> tuple[list[dict], list[dict]]:
    rows, ref = result
    return rows, [ref]


def new_document(plan: Plan) -> dict[str, Any]:
    """The result document before any measurement (``complete`` false)."""
    works = list(plan.workloads) if "speed" in plan.rows else []
    if "frozen" in plan.rows:
        works += frozen.workloads(quick=plan.quick)
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "quick": plan.quick,
        "device": str(plan.device),
        "dtype": str(plan.dtype).replace("torch.", ""),
        "machine": describe(plan.device),
        "settings": plan.settings,
        "budget_s": plan.budget_s,
        "rows": list(plan.rows),
        "optimizers": list(plan.optimizers),
        "candidates": list(CANDIDATES),
        "workloads": [w.describe() for w in works],
        "results": [], "references": [], "memory": [], "graphs": [], "instances": [], "host_work": [], "lowbit": [],
        "nonepattern": [], "construction": [], "loops": [], "loops_eager": [], "wholemem": [],
        "errors": [], "skipped": [], "not_measured": plan.not_measured, "elapsed_s": 0.0, "targets": [],
    }


def run_plan(plan: Plan, *, log: Log = print, progress: Callable[[int, int, str], None] | None = None,
             checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run every task of ``plan``; return the result document (see ``bench/README.md``).

    ``log(message)`` gets a line when a task starts, its results, and any
    failure; ``progress(done, total, label)`` is called after each task;
    ``checkpoint(doc)`` too (the document so far).
    """
    doc = new_document(plan)
    t0 = time.perf_counter()
    for done, task in enumerate(plan.tasks, 1):
        if plan.budget_s is not None and time.perf_counter() - t0 > plan.budget_s:
            doc["skipped"].append(task.label)
            log(f"skipped (--budget {plan.budget_s:g} s spent): {task.label}")
        else:
            log(f"measuring {task.label} ...")
            try:
                task.run(doc, log)
            except Exception as exc:  # one row's failure is recorded; the run goes on
                doc["errors"].append({"row": task.row, "task": task.label, "error": error_text(exc)})
                log(f"  FAILED: {task.label}: {error_text(exc)}")
            free(plan.device)
        doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
        record_targets(doc)
        if checkpoint is not None:
            checkpoint(doc)
        if progress is not None:
            progress(done, len(plan.tasks), task.label)
    doc["complete"] = True
    load = load_average()
    if load is not None:
        doc["machine"]["loadavg_end"] = load
    if checkpoint is not None:
        checkpoint(doc)
    return doc
