"""The None-pattern row: steps where a changing 70% of the parameters have a gradient, beside steady steps.

40 parameters of 128 x 128 (16,384 elements each; ``--quick``: 16 x 16).
At each step a seeded random 70% of them (28 of 40) have a gradient and the
others ``p.grad = None``, and the pattern changes every step: 64 patterns
(16 with ``--quick``) are drawn once and cycled.  The gradients are assigned
from one set of preallocated tensors that every candidate shares, read only
(dml_optim copies them into its flat gradient buffer, torch.optim reads
them), so assigning costs the same for each: what a loop pays after
``zero_grad(set_to_none=True)`` and a backward that reaches 70% of the
parameters.

Candidates, each on its own copy of the same parameters, alive in one
process and timed round-robin (:func:`~dml_optim.benchmark.timing.round_robin`):
``dml_optim auto`` (the default backend: what it runs for parameters at
several step counts has a threshold of its own, so it is measured, not
predicted), ``dml_optim eager``, ``dml_optim compiled`` and ``torch fused``,
each ``changing`` (the patterns) and ``steady`` (every gradient present at
every step, assigned the same way).  Before timing, each takes one cycle of
patterns: a parameter skipped at a step keeps its own step count, as in
torch.optim, so the counts spread apart over the first steps, and a
dml_optim step runs its rule once per distinct count among the parameters
it updates.  A candidate that fails there (``torch.optim.SGD(fused=True)``
refuses a parameter whose momentum buffer is still ``None``) is n/a, with
the reason.

Per candidate: ``ms_per_step`` (median), ``ms_min`` and ``ms_max`` (the
spread), ``round_ms`` (the sample of each round, in order), ``first_step_ms``, ``ops_per_step`` (the mean over one cycle of
patterns, :func:`dml_optim.core.opcount.count_ops`), ``steps_taken`` and
``distinct_step_counts`` (among the parameters, after the last step);
``error``: a part that failed (counting the ops).
The record's ``auto_runs`` is what ``dml_optim auto``'s buffers ran in the
changing mode after its timed steps (:func:`~dml_optim.benchmark.candidates.ran`:
``fused`` on the CPU, where torch's kernel takes one range per run of
parameters at one step count; None where it is n/a).
The record's ratios are the targets' values (:mod:`~dml_optim.benchmark.targets`):
``ratio_changing_to_steady`` (``dml_optim auto``'s changing step over its
steady one, at most :data:`CHANGING_LIMIT`) and ``ratio_fused_to_ours``
(torch fused's changing step over ``dml_optim auto``'s, at least
:data:`VS_FUSED_LIMIT`), each the median of the ratios of the rounds
(:func:`~dml_optim.benchmark.timing.paired_ratio`; records before
``round_ms``: the ratio of the medians), with its quartiles
(``spread_changing_to_steady``, ``spread_fused_to_ours``; None in those).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from dml_optim.benchmark.candidates import AUTO, build_optimizer, no_compile_fallback, ran, settle_steps, unavailable
from dml_optim.benchmark.common import error_text
from dml_optim.benchmark.timing import round_robin, rows_ratio, wall_seconds
from dml_optim.benchmark.workloads import Workload, make_params, make_values, tensors
from dml_optim.core.opcount import count_ops

__all__ = ["CANDIDATES", "MODES", "CHANGING_LIMIT", "VS_FUSED_LIMIT", "ROW_FIELDS", "workload", "draw_patterns",
           "PatternStepper", "blank_row", "find_row", "make_record", "measure_nonepattern"]

CANDIDATES = (AUTO, "dml_optim eager", "dml_optim compiled", "torch fused")
MODES = ("changing", "steady")
#: Target: dml_optim's step with changing None patterns costs at most this many times its steady step.
CHANGING_LIMIT = 1.5
#: Target: torch fused's changing step over dml_optim's is at least this.
VS_FUSED_LIMIT = 1.0
#: The fields of every candidate's row (None where not measured).
ROW_FIELDS = ("candidate", "mode", "available", "reason", "ms_per_step", "ms_min", "ms_max", "samples", "inner_steps",
              "round_ms", "first_step_ms", "ops_per_step", "steps_taken", "distinct_step_counts", "error")
_COUNT, _PRESENT, _SEED = 40, 28, 23
_SHAPE, _QUICK_SHAPE = (128, 128), (16, 16)
_PATTERNS, _QUICK_PATTERNS = 64, 16


def workload(*, quick: bool) -> Workload:
    """The row's parameters: 40 x 128 x 128 (``quick``: 40 x 16 x 16)."""
    return tensors(_COUNT, _QUICK_SHAPE if quick else _SHAPE)


def draw_patterns(count: int, present: int, patterns: int, seed: int) -> list[tuple[bool, ...]]:
    """``patterns`` masks over ``count`` parameters, each with exactly ``present`` of them True, drawn with a
    seeded generator (the same on every machine)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(patterns):
        chosen = set(torch.randperm(count, generator=gen)[:present].tolist())
        out.append(tuple(i in chosen for i in range(count)))
    return out


class PatternStepper:
    """An optimizer stepped through a cycle of gradient patterns: :meth:`step` assigns the pattern's gradients
    (``None`` where it is False), then steps.  The gradient lists are built once, so assigning is one
    ``p.grad = g`` per parameter, the same for every candidate."""

    def __init__(self, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: Sequence[torch.Tensor],
                 patterns: Sequence[tuple[bool, ...]]):
        self.opt = opt
        self.params = params
        self.patterns = list(patterns)
        self._assignments = [[g if present else None for g, present in zip(grads, mask)] for mask in self.patterns]
        self.steps_taken = 0

    def step(self) -> None:
        grads = self._assignments[self.steps_taken % len(self._assignments)]
        self.steps_taken += 1
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt.step()

    def distinct_step_counts(self) -> int:
        """How many different step counts the parameters have now (1: all took every step)."""
        cycles, part = divmod(self.steps_taken, len(self.patterns))
        counts = {cycles * sum(m[i] for m in self.patterns) + sum(m[i] for m in self.patterns[:part])
                  for i in range(len(self.params))}
        return len(counts)

    def ops_per_step(self) -> float:
        """Ops per step, the mean over one cycle of patterns (:func:`dml_optim.core.opcount.count_ops`)."""
        steps = len(self.patterns)
        return count_ops(lambda: [self.step() for _ in range(steps)]) / steps


def _start(name: str, optimizer: str, work: Workload, values: list, grads: list, patterns: list,
           burn_in: int, device: torch.device, settle: bool = True) -> tuple[PatternStepper, float]:
    """Candidate ``name`` stepping ``patterns``, and its first step's seconds; it has taken ``burn_in`` steps."""
    params = make_params(work, values)
    with no_compile_fallback():
        stepper = PatternStepper(build_optimizer(name, optimizer, params), params, grads, patterns)
        first_s = wall_seconds(stepper.step, device, probe=params[-1])
        for _ in range(burn_in - 1):
            stepper.step()
    if name == AUTO and settle:
        settle_steps(stepper.opt, stepper.step)
    return stepper, first_s


def blank_row(name: str, mode: str) -> dict[str, Any]:
    """A candidate's row before it is measured (n/a until then)."""
    row = dict.fromkeys(ROW_FIELDS)
    row.update(candidate=name, mode=mode, available=False)
    return row


def _ratio(numerator: dict | None, denominator: dict | None) -> tuple[float | None, list[float] | None]:
    """``numerator``'s time over ``denominator``'s, round by round, and the quartiles (None, None: one is n/a)."""
    if numerator is None or denominator is None or None in (numerator["ms_per_step"], denominator["ms_per_step"]):
        return None, None
    return rows_ratio(numerator, denominator)


def find_row(rows: list[dict], candidate: str, mode: str) -> dict | None:
    """The row of ``candidate`` in ``mode`` (``changing``, ``steady``), or None."""
    return next((r for r in rows if (r["candidate"], r["mode"]) == (candidate, mode)), None)


def make_record(optimizer: str, work: Workload, patterns: int, rows: list[dict],
                auto_runs: str | None = None) -> dict[str, Any]:
    """The row's record from its candidates' ``rows``: the setting, the limits, what ``dml_optim auto`` ran
    (``auto_runs``), and the targets' ratios (``dml_optim auto``'s changing over steady; torch fused's changing
    over ``dml_optim auto``'s)."""
    ours = find_row(rows, AUTO, "changing")
    changing_to_steady, spread_steady = _ratio(ours, find_row(rows, AUTO, "steady"))
    fused_to_ours, spread_fused = _ratio(find_row(rows, "torch fused", "changing"), ours)
    return {
        "optimizer": optimizer, "workload": work.name, "tensors": len(work.shapes),
        "elements_per_tensor": math.prod(work.shapes[0]),
        "present": _PRESENT, "patterns": patterns, "seed": _SEED, "auto_runs": auto_runs,
        "changing_limit": CHANGING_LIMIT, "vs_fused_limit": VS_FUSED_LIMIT,
        "ratio_changing_to_steady": changing_to_steady, "spread_changing_to_steady": spread_steady,
        "ratio_fused_to_ours": fused_to_ours, "spread_fused_to_ours": spread_fused,
        "rows": rows,
    }


def _start_all(optimizer: str, work: Workload, patterns: list, device: torch.device, dtype: torch.dtype,
               log: Callable[[str], None], settle: bool = True
               ) -> tuple[dict[str, dict], dict[str, PatternStepper], dict[str, float]]:
    """Every candidate in both modes, each past its burn-in: the rows (keyed ``"candidate, mode"``; n/a ones
    with the reason), the steppers that run, and their first steps' seconds."""
    every = [(True,) * len(work.shapes)]
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    grads = make_values(work, device, dtype, seed=7, scale=1e-2)
    rows: dict[str, dict] = {}
    steppers: dict[str, PatternStepper] = {}
    first: dict[str, float] = {}
    for name in CANDIDATES:
        for mode in MODES:
            key = f"{name}, {mode}"
            rows[key] = row = blank_row(name, mode)
            row["reason"] = unavailable(name, device)
            if row["reason"] is None:
                try:
                    steppers[key], first[key] = _start(name, optimizer, work, values, grads,
                                                       patterns if mode == "changing" else every, len(patterns), device,
                                                       settle)
                    row.update(available=True, first_step_ms=first[key] * 1e3)
                except Exception as exc:  # torch.optim.SGD(fused=True) refuses new momentum buffers, a compile failed, ...
                    row["reason"] = error_text(exc)
            if row["reason"] is not None:
                log(f"  {optimizer:8} None patterns {key:28} n/a ({row['reason']})")
    return rows, steppers, first


def measure_nonepattern(optimizer: str, device: torch.device, dtype: torch.dtype, settings: dict,
                        log: Callable[[str], None], *, quick: bool) -> dict[str, Any]:
    """The None-pattern row of ``optimizer``: its record (see the module docstring)."""
    work = workload(quick=quick)
    patterns = draw_patterns(_COUNT, _PRESENT, _QUICK_PATTERNS if quick else _PATTERNS, _SEED)
    rows, steppers, first = _start_all(optimizer, work, patterns, device, dtype, log, settings.get("settle", True))
    probe = next(iter(steppers.values())).params[-1] if steppers else None
    timed = round_robin({k: s.step for k, s in steppers.items()},
                        lambda fn, inner: wall_seconds(fn, device, inner, probe), settings, first)
    for key, stepper in steppers.items():
        t = timed[key]
        rows[key].update(ms_per_step=t["seconds"] * 1e3, ms_min=t["min_seconds"] * 1e3, ms_max=t["max_seconds"] * 1e3,
                         samples=t["samples"], inner_steps=t["inner"], round_ms=[x * 1e3 for x in t["round_seconds"]])
        try:
            rows[key]["ops_per_step"] = stepper.ops_per_step()
        except Exception as exc:  # recorded; the row keeps its times
            rows[key]["error"] = error_text(exc)
        rows[key].update(steps_taken=stepper.steps_taken, distinct_step_counts=stepper.distinct_step_counts())
    auto = steppers.get(f"{AUTO}, changing")
    record = make_record(optimizer, work, len(patterns), list(rows.values()), ran(auto.opt) if auto else None)
    log(f"  {optimizer:8} None patterns (auto: {record['auto_runs'] or 'n/a'}): " + ", ".join(
        f"{r['candidate']} {r['mode']} {_ms(r['ms_per_step'])}" for r in record["rows"]))
    return record


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"
