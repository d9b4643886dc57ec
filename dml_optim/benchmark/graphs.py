"""The CUDA-graph row: many small tensors, ``capturable=True``, one step captured and replayed.

Over ``many-small`` (2,000 tensors of 1,024 elements; ``many-small-256`` with
``--quick``), Adam candidates built with ``capturable=True`` (step counts and
coefficients on the device): dml_optim eager and compiled, torch.optim
foreach and fused.  Each runs its first step, three warm-up steps on a side
stream, and one ``opt.step()`` captured in a ``torch.cuda.CUDAGraph``; a
second instance of each is stepped without a graph.  Replays (``graph``) and
plain steps (``steps``) are timed with CUDA events around back-to-back calls,
round-robin, medians.  Target: dml_optim's ``auto`` backend replayed in a
graph at most 0.1 ms per step.
"""

from __future__ import annotations

from typing import Callable

import torch

from dml_optim.benchmark.candidates import auto_backend, start
from dml_optim.benchmark.common import error_text
from dml_optim.benchmark.timing import event_seconds, round_robin
from dml_optim.benchmark.workloads import make_params, make_values, workload

__all__ = ["GRAPH_CANDIDATES", "GRAPH_LIMIT_MS", "measure_graphs"]

GRAPH_CANDIDATES = ("dml_optim eager", "dml_optim compiled", "torch foreach", "torch fused")
#: Target: dml_optim's ``auto`` backend, replayed in a graph, at most this many ms per step on many-small.
GRAPH_LIMIT_MS = 0.1
_WARMUP_STEPS = 3


def _capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(_WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def measure_graphs(device: torch.device, dtype: torch.dtype, settings: dict, log: Callable[[str], None], *,
                   quick: bool) -> dict:
    """The CUDA-graph row: ``{"workload", "auto_backend", "rows": [...]}`` (``auto_backend``: what
    ``backend="auto"`` runs with ``capturable=True``, :func:`~dml_optim.benchmark.candidates.auto_backend`)."""
    if device.type != "cuda":
        raise RuntimeError(f"the CUDA-graph row needs --device cuda, got {device.type}")
    work = workload("many-small-256" if quick else "many-small")
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    grads = make_values(work, device, dtype, seed=7, scale=1e-2)
    rows, steps, keep = [], {}, []
    for name in GRAPH_CANDIDATES:
        for mode in ("graph", "steps"):
            row = {"candidate": name, "mode": mode, "available": False, "reason": None, "ms_per_step": None,
                   "samples": None, "first_step_ms": None}
            rows.append(row)
            try:
                cand = start(name, "adam", make_params(work, values), grads, device, capturable=True)
                row["first_step_ms"] = cand.first_step_s * 1e3
                if mode == "graph":
                    graph = _capture(cand.step)
                    keep.append(graph)
                    steps[(name, mode)] = graph.replay
                else:
                    steps[(name, mode)] = cand.step
                keep.append(cand)
                row["available"] = True
            except Exception as exc:  # capture refused, compile failed, ...
                row["reason"] = error_text(exc)
                log(f"  graph {name:20} {mode:5} n/a ({row['reason']})")
    timed = round_robin({f"{n}|{m}": fn for (n, m), fn in steps.items()}, event_seconds, settings)
    for row in rows:
        t = timed.get(f"{row['candidate']}|{row['mode']}")
        if t is not None:
            row.update(ms_per_step=t["seconds"] * 1e3, samples=t["samples"])
    auto = auto_backend("adam", device, dtype, work.trainable_numel, capturable=True)
    log("  graph: " + ", ".join(f"{r['candidate']} ({r['mode']}) {_ms(r['ms_per_step'])}" for r in rows))
    return {"workload": work.name, "optimizer": "adam", "auto_backend": auto, "limit_ms": GRAPH_LIMIT_MS, "rows": rows}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f} ms"
