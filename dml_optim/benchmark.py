"""Optimizer-step benchmark: dml_optim's backends side by side with torch.optim.

For each optimizer (Adam, Adagrad, Momentum) and workload (parameter shapes of
resnet50, bert-base-uncased, gpt2; 2,000 tensors of 1,024 elements; one tensor
of 64M elements), every candidate is built on its own copy of the same
parameters and gradients:

* ``dml_optim eager`` and ``dml_optim compiled`` (``backend=`` each),
* ``torch for-loop`` (``foreach=False``), ``torch foreach`` (``foreach=True``)
  and ``torch fused`` (``fused=True``; ``n/a`` where torch refuses it for
  that optimizer, device or dtype).

Equivalent configurations (DESIGN.md §2): ``Adam(lr=1e-3, alpha=0.9,
beta=0.999, epsilon=1e-8)`` vs ``torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999),
eps=1e-8)`` (epsilon placement differs; irrelevant for speed);
``Adagrad(lr=1e-2, epsilon=1e-10)`` vs ``torch.optim.Adagrad(lr=1e-2,
eps=1e-10)``; ``Momentum(lr=1e-2, alpha=0.9, beta=1)`` vs
``torch.optim.SGD(lr=1e-2, momentum=0.9, dampening=0)``.

Method: all candidates of one (optimizer, workload) live in one process at
once; after a first step (timed separately: it includes compilation and state
allocation) and warm-up steps, samples are taken round-robin (the order
rotates every round) together with a bandwidth reference, the triad
``a = b + s * c`` over the same number of elements; the figure reported is
the median.  On CUDA every sample is bracketed by ``torch.cuda.synchronize()``.

Reported per candidate: ms per step, steps/s ratio to the best torch.optim
variant, effective GB/s (the minimum bytes a step must move, see
:data:`BYTES_PER_ELEMENT`, divided by the time), the fraction of the triad's
GB/s, ops per step (aten ops that do work, views excluded; a compiled graph
counts as one fused kernel per call), and the memory the optimizer allocates
beyond parameters and gradients (states, scratch and master copy for
dml_optim; the state tensors for torch.optim).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dml_optim.console import DEFAULT_OUTPUT_DIR

__all__ = [
    "OPTIMIZERS",
    "CANDIDATES",
    "FULL_WORKLOADS",
    "QUICK_WORKLOADS",
    "BYTES_PER_ELEMENT",
    "Workload",
    "workload",
    "run_benchmark",
    "check_targets",
    "format_table",
    "default_output_path",
    "write_json",
    "count_ops",
]

OPTIMIZERS = ("adam", "adagrad", "momentum")
CANDIDATES = ("dml_optim eager", "dml_optim compiled", "torch for-loop", "torch foreach", "torch fused")
TORCH_CANDIDATES = CANDIDATES[2:]
FULL_WORKLOADS = ("resnet50", "bert-base-uncased", "gpt2", "many-small", "one-64m")
QUICK_WORKLOADS = ("many-small-256",)

#: Minimum traffic of one step, in elements read + written per parameter:
#: Adam reads x, g, v, h and writes x, v, h; Adagrad and Momentum read x, g,
#: one state and write x and the state.  The triad reads 2 and writes 1.
BYTES_PER_ELEMENT = {"adam": 7, "adagrad": 5, "momentum": 5, "triad": 3}

_HYPER = {
    "adam": (dict(lr=1e-3, alpha=0.9, beta=0.999, epsilon=1e-8), dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)),
    "adagrad": (dict(lr=1e-2, epsilon=1e-10), dict(lr=1e-2, eps=1e-10)),
    "momentum": (dict(lr=1e-2, alpha=0.9, beta=1.0), dict(lr=1e-2, momentum=0.9, dampening=0.0)),
}


@dataclass(frozen=True)
class Workload:
    """A named list of parameter shapes."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    source: str

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def workload(name: str) -> Workload:
    """A workload: any model :func:`dml_optim.inventory.resolve_model` accepts.

    A built-in inventory (``resnet50``, ``many-small``: 2,000 x 1,024, ...), a
    synthetic name (``many-small-N``: N x 1,024; ``one-Nm`` / ``one-Nk``: one
    tensor of N * 2**20 / N * 2**10 elements, ``one-64m`` is 2**26), or the
    path of an inventory file.  ``ValueError`` (one line, listing the known
    names) otherwise.
    """
    from dml_optim.inventory import resolve_model

    inv = resolve_model(name)
    return Workload(inv.name, tuple(s for _, s in inv.parameters), inv.source)


# --------------------------------------------------------------------------
# candidates
# --------------------------------------------------------------------------


class _Candidate:
    """One optimizer instance over its own parameters; ``step()`` is timed."""

    def __init__(self, name: str, opt, params: list[torch.Tensor], probe: torch.Tensor):
        self.name = name
        self.opt = opt
        self.params = params
        self.probe = probe  # a tensor the step writes, for syncing lazy devices
        self.samples: list[float] = []
        self.first_step_s: float | None = None

    def step(self) -> None:
        self.opt.step()

    def optimizer_bytes(self) -> int:
        if self.name.startswith("dml_optim"):
            total = 0
            for info in self.opt.flat_buffers():
                tensors = list(info.states.values()) + list(info.scratch)
                tensors += [t for t in (info.master, info.kahan) if t is not None]
                total += sum(t.numel() * t.element_size() for t in tensors)
            return total
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))


def _make_params(work: Workload, device, dtype, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.1).to(device=device, dtype=dtype)) for s in work.shapes]


def _build(name: str, optimizer: str, work: Workload, device, dtype, grads: list[torch.Tensor]) -> _Candidate:
    import dml_optim

    params = _make_params(work, device, dtype, seed=0)
    ours, theirs = _HYPER[optimizer]
    if name.startswith("dml_optim"):
        for p, g in zip(params, grads):
            p.grad = g.clone()  # packed into the optimizer's own flat gradient buffer
        cls = {"adam": dml_optim.Adam, "adagrad": dml_optim.Adagrad, "momentum": dml_optim.Momentum}[optimizer]
        opt = cls(params, **ours, backend=name.split()[-1])
    else:
        for p, g in zip(params, grads):
            p.grad = g  # shared, read-only for these optimizers
        cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "momentum": torch.optim.SGD}[optimizer]
        flag = {"torch for-loop": dict(foreach=False), "torch foreach": dict(foreach=True), "torch fused": dict(fused=True)}[name]
        opt = cls(params, **theirs, **flag)
    return _Candidate(name, opt, params, params[-1])


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why a candidate cannot run here (None: it can)."""
    if name == "dml_optim compiled":
        from dml_optim.compiled import compile_available

        ok, why = compile_available(device.type)
        return None if ok else why
    return None


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------


def _sync(device: torch.device, probe: torch.Tensor | None = None) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and probe is not None:
        probe.reshape(-1)[:1].cpu()  # lazy backends (DirectML): wait for the queue


def _time(fn: Callable[[], None], device: torch.device, probe, inner: int = 1) -> float:
    _sync(device, probe)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    _sync(device, probe)
    return (time.perf_counter() - t0) / inner


class _Triad:
    """The bandwidth reference ``a = b + s * c`` over ``n`` elements."""

    name = "triad"

    def __init__(self, n: int, device, dtype):
        gen = torch.Generator().manual_seed(1)
        self.b = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        self.c = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        self.a = torch.empty_like(self.b)
        self.probe = self.a
        self.samples: list[float] = []

    def step(self) -> None:
        torch.add(self.b, self.c, alpha=0.5, out=self.a)


# --------------------------------------------------------------------------
# op counting
# --------------------------------------------------------------------------


def count_ops(step: Callable[[], None]) -> int:
    """Ops per call of ``step``, as :func:`dml_optim.opcount.count_ops` defines them (views
    excluded; a compiled kernel call is one op)."""
    from dml_optim.opcount import count_ops as _count

    return _count(step, compiled=True)


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------


def _machine(device: torch.device) -> dict[str, Any]:
    import dml_optim

    info = {
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
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = list(os.getloadavg())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _group(optimizer: str, work: Workload, device: torch.device, dtype: torch.dtype, settings: dict,
           log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """Measure every candidate of one (optimizer, workload) round-robin."""
    from dml_optim.backends import resolve
    from dml_optim.compiled import CompileFallbackWarning

    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=gen).mul_(1e-2).to(device=device, dtype=dtype) for s in work.shapes]
    cands: list[_Candidate] = []
    rows: dict[str, dict] = {}
    for name in CANDIDATES:
        row = {"optimizer": optimizer, "workload": work.name, "candidate": name, "available": False, "reason": None}
        rows[name] = row
        why = _unavailable(name, device)
        if why is None:
            try:
                with warnings.catch_warnings():
                    # a compile fallback must not pass for "compiled": make it an error here
                    warnings.simplefilter("error", CompileFallbackWarning)
                    cand = _build(name, optimizer, work, device, dtype, grads)
                    cand.first_step_s = _time(cand.step, device, cand.probe)
                cands.append(cand)
                row["available"] = True
            except Exception as exc:  # torch refuses fused for this device/dtype, compile failed, ...
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        row["reason"] = why
        if why:
            log(f"  {optimizer:8} {work.name:18} {name:20} n/a ({why})")
    triad = _Triad(work.numel, device, dtype)
    timed = cands + [triad]
    for c in timed:  # warm-up (one step only where a step takes seconds)
        slow = getattr(c, "first_step_s", None) is not None and c.first_step_s > 2.0
        for _ in range(1 if slow else settings["warmup"]):
            _time(c.step, device, c.probe)
    inner = {}
    for c in timed:
        t = _time(c.step, device, c.probe)
        inner[c.name] = max(1, min(50, int(settings["min_sample_s"] / max(t, 1e-9))))
    round_s = sum(_time(c.step, device, c.probe) * inner[c.name] for c in timed)
    rounds = max(settings["min_rounds"], min(settings["rounds"], int(settings["group_budget_s"] / max(round_s, 1e-9))))
    for r in range(rounds):
        k = r % len(timed)
        for c in timed[k:] + timed[:k]:
            c.samples.append(_time(c.step, device, c.probe, inner[c.name]))
    triad_s = statistics.median(triad.samples)
    elem = torch.empty((), dtype=dtype).element_size()
    triad_gbs = BYTES_PER_ELEMENT["triad"] * elem * work.numel / triad_s / 1e9
    step_bytes = BYTES_PER_ELEMENT[optimizer] * elem * work.numel
    for c in cands:
        ms = statistics.median(c.samples) * 1e3
        row = rows[c.name]
        row.update(
            ms_per_step=ms,
            steps_per_s=1e3 / ms,
            gbs=step_bytes / (ms / 1e3) / 1e9,
            ops_per_step=count_ops(c.step),
            optimizer_bytes=c.optimizer_bytes(),
            first_step_ms=c.first_step_s * 1e3,
            samples=len(c.samples),
            inner_steps=inner[c.name],
        )
        row["fraction_of_triad"] = row["gbs"] / triad_gbs
        row["compile_s"] = max(0.0, c.first_step_s - ms / 1e3) if c.name == "dml_optim compiled" else None
    torch_ms = [rows[n]["ms_per_step"] for n in TORCH_CANDIDATES if rows[n]["available"]]
    best = min(torch_ms) if torch_ms else None
    fields = ("ms_per_step", "steps_per_s", "ratio_to_best_torch", "gbs", "fraction_of_triad", "ops_per_step",
              "optimizer_bytes", "first_step_ms", "compile_s", "samples", "inner_steps")
    for row in rows.values():
        for f in fields:
            row.setdefault(f, None)
        if row["available"] and best is not None:
            row["ratio_to_best_torch"] = best / row["ms_per_step"]
    auto = resolve("auto", device, work.numel)
    ref = {"optimizer": optimizer, "workload": work.name, "triad_ms": triad_s * 1e3, "triad_gbs": triad_gbs,
           "auto_backend": auto, "rounds": rounds}
    del cands, triad, grads
    gc.collect()
    return list(rows.values()), ref


def run_benchmark(
    *,
    device: str = "cpu",
    quick: bool = False,
    optimizers: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return the result document (see ``bench/README.md``).

    ``log(message)`` gets a line when a measurement starts and when a candidate
    is not available; ``progress(done, total, what)`` is called after each
    (optimizer, workload) group.  ``ValueError`` naming the value when
    ``device``, an optimizer or a workload is unusable.
    """
    from dml_optim.training import resolve_device

    dev = resolve_device(device)
    optimizers = list(optimizers or OPTIMIZERS)
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"optimizer {o!r} is unknown (known: {', '.join(OPTIMIZERS)})")
    works = [workload(w) for w in (workloads or (QUICK_WORKLOADS if quick else FULL_WORKLOADS))]
    settings = (dict(warmup=1, rounds=3, min_rounds=3, min_sample_s=0.002, group_budget_s=2.0) if quick
                else dict(warmup=2, rounds=9, min_rounds=3, min_sample_s=0.02, group_budget_s=60.0))
    doc: dict[str, Any] = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "device": str(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "machine": _machine(dev),
        "settings": settings,
        "candidates": list(CANDIDATES),
        "workloads": [{"name": w.name, "source": w.source, "tensors": len(w.shapes), "elements": w.numel} for w in works],
        "results": [],
        "references": [],
    }
    groups = [(work, optimizer) for work in works for optimizer in optimizers]
    for done, (work, optimizer) in enumerate(groups, 1):
        log(f"measuring {optimizer} on {work.name} ({len(work.shapes)} tensors, {work.numel:,} elements) ...")
        rows, ref = _group(optimizer, work, dev, dtype, settings, log)
        doc["results"].extend(rows)
        doc["references"].append(ref)
        if progress is not None:
            progress(done, len(groups), f"{optimizer} on {work.name}")
    if hasattr(os, "getloadavg"):
        doc["machine"]["loadavg_end"] = list(os.getloadavg())
    doc["targets"] = check_targets(doc)
    return doc


# --------------------------------------------------------------------------
# targets and reporting
# --------------------------------------------------------------------------


def _row(doc, optimizer, work, candidate):
    for r in doc["results"]:
        if r["optimizer"] == optimizer and r["workload"] == work and r["candidate"] == candidate:
            return r
    return None


def _ref(doc, optimizer, work):
    for r in doc["references"]:
        if r["optimizer"] == optimizer and r["workload"] == work:
            return r
    return None


def check_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and PASS/MISS (None: not measured).

    "dml_optim" means what ``backend="auto"`` (the default) runs for that
    buffer size on that device.
    """
    dev = torch.device(doc["device"]).type
    out = []

    def add(name, optimizer, work, required, measure, unit):
        ref = _ref(doc, optimizer, work)
        value = None
        backend = None
        if ref is not None:
            backend = ref["auto_backend"]
            row = _row(doc, optimizer, work, f"dml_optim {backend}")
            if row is not None and row["available"]:
                value = measure(row, ref)
        out.append({"target": name, "optimizer": optimizer, "workload": work, "dml_backend": backend,
                    "required": required, "measured": value, "unit": unit,
                    "pass": None if value is None else value >= required})

    def vs(candidate):
        def measure(row, ref):
            other = _row(doc, row["optimizer"], row["workload"], candidate)
            if other is None or not other["available"]:
                return None
            return other["ms_per_step"] / row["ms_per_step"]
        return measure

    if dev == "cpu":
        add("resnet50 Adam >= 1.1x torch fused", "adam", "resnet50", 1.1, vs("torch fused"), "x")
        add("resnet50 Adagrad >= 1.0x torch fused", "adagrad", "resnet50", 1.0, vs("torch fused"), "x")
        add("resnet50 Momentum >= 1.0x torch fused (SGD)", "momentum", "resnet50", 1.0, vs("torch fused"), "x")
    elif dev == "cuda":
        for o in OPTIMIZERS:
            add(f"resnet50 {o} >= 1.0x torch fused", o, "resnet50", 1.0, vs("torch fused"), "x")
    for o in OPTIMIZERS:
        add(f"many-small {o} >= 3x torch foreach", o, "many-small", 3.0, vs("torch foreach"), "x")
    for o in OPTIMIZERS:
        add(f"one-64m {o} >= 70% of triad bandwidth", o, "one-64m", 0.7,
            lambda row, ref: row["fraction_of_triad"], "fraction")
    for t in out:
        if t["pass"] is None:
            t["status"] = "not measured"
        else:
            t["status"] = "PASS" if t["pass"] else "MISS"
    return out


def _fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def format_table(doc: dict[str, Any]) -> str:
    """The results as a markdown table, then the targets."""
    lines = [
        f"device: {doc['device']} ({doc['machine'].get('cpu_model', doc['machine'].get('processor'))}, "
        f"{doc['machine'].get('cpu_count')} CPUs, torch {doc['machine']['torch']}, {doc['dtype']}), {doc['created']}",
        "",
        "| optimizer | workload | candidate | ms/step | vs best torch | GB/s | % triad | ops/step | optimizer MB | first step ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        ref = _ref(doc, r["optimizer"], r["workload"])
        name = r["candidate"]
        if ref and name == f"dml_optim {ref['auto_backend']}":
            name += " (auto)"
        if not r["available"]:
            lines.append(f"| {r['optimizer']} | {r['workload']} | {name} | n/a | | | | | | |")
            continue
        lines.append(
            f"| {r['optimizer']} | {r['workload']} | {name} | {r['ms_per_step']:.2f} | "
            f"{_fmt(r['ratio_to_best_torch'], '.2f')}x | {r['gbs']:.2f} | {100 * r['fraction_of_triad']:.0f}% | "
            f"{r['ops_per_step']} | {r['optimizer_bytes'] / 2**20:.1f} | {r['first_step_ms']:.1f} |"
        )
    lines += ["", "| bandwidth reference (triad a = b + s*c) | workload | ms | GB/s |", "|---|---|---:|---:|"]
    for ref in doc["references"]:
        lines.append(f"| measured with {ref['optimizer']} | {ref['workload']} | {ref['triad_ms']:.2f} | {ref['triad_gbs']:.2f} |")
    compiles = [r for r in doc["results"] if r["candidate"] == "dml_optim compiled" and r["available"]]
    if compiles:
        lines += ["", "| compile time (first compiled step minus a steady step) | workload | s |", "|---|---|---:|"]
        for r in compiles:
            lines.append(f"| {r['optimizer']} | {r['workload']} | {r['compile_s']:.2f} |")
    lines += ["", "| target | dml_optim backend | measured | required | status |", "|---|---|---:|---:|---|"]
    for t in doc["targets"]:
        lines.append(f"| {t['target']} | {t['dml_backend'] or 'n/a'} | {_fmt(t['measured'], '.2f')} | {t['required']} | {t['status']} |")
    return "\n".join(lines)


def default_output_path(device: str, root: Path = DEFAULT_OUTPUT_DIR, *, quick: bool = False) -> Path:
    """``<root>/bench/<device>-<UTC date>.json`` (``...-quick.json`` for ``--quick``).

    ``root`` defaults to :data:`dml_optim.console.DEFAULT_OUTPUT_DIR`
    (``dml-optim-out``, relative to the working directory).  The repository's
    recorded results live in ``bench/results/`` and are written there only
    with an explicit ``--out``.
    """
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    suffix = "-quick" if quick else ""
    return Path(root) / "bench" / f"{device.split(':')[0]}-{date}{suffix}.json"


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write ``doc`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
