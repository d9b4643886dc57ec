"""The frozen-parameter rows: a LoRA-shaped model, and gradual unfreezing.

* **LoRA** (:func:`measure_lora`): :func:`~dml_optim.benchmark.workloads.lora`,
  16 frozen 512x512 Linear layers (``requires_grad=False``), each followed by
  a trainable rank-8 adapter; ``model.parameters()``, frozen ones included,
  go to every candidate.  A speed row (:mod:`~dml_optim.benchmark.speed`):
  state bytes, ops per step and step time beside torch.optim's for-loop,
  foreach and fused, in one run.  Besides the speed rows' candidates,
  ``dml_optim auto`` (:data:`CANDIDATES`): after unfreezing, parameters are
  at several step counts and ``backend="auto"`` picks the backend of that
  update by its own threshold, so the rows time what it runs rather than
  predict it (on the CPU it runs torch's fused kernel, one range per run of
  parameters at one step count: the reference record's ``auto_runs`` says
  what it ran, and the tables show that).
* **Gradual unfreezing** (:func:`measure_unfreezing`): 16 Linear(512, 512)
  layers; the same candidates, built once with every parameter, step while
  the top 1, then 4, then all 16 layers are trainable.  At each stage the
  newly unfrozen parameters get gradients and the first step after
  unfreezing is timed on its own (dml_optim packs the new parameters there):
  it is the stage's ``first_step_ms``.  Then the stage is a speed row
  (``workload`` ``unfreeze-KofNxD``).
"""

from __future__ import annotations

from typing import Callable

import torch

from dml_optim.benchmark.candidates import AUTO, CANDIDATES as SPEED_CANDIDATES
from dml_optim.benchmark.common import error_text
from dml_optim.benchmark.speed import gradients, measure, measure_group, start_candidates
from dml_optim.benchmark.timing import wall_seconds
from dml_optim.benchmark.workloads import Workload, lora, unfreezing

__all__ = ["CANDIDATES", "UNFREEZE_STAGES", "workloads", "measure_lora", "measure_unfreezing"]

#: The candidates of these rows: dml_optim's default backend, then the speed rows'.
CANDIDATES = (AUTO, *SPEED_CANDIDATES)
#: Trainable layers (of 16, from the top) at each stage of the unfreezing row.
UNFREEZE_STAGES = (1, 4, 16)
#: Layer width of the full rows; ``--quick`` uses 64.
_WIDTH = 512
_QUICK_WIDTH = 64


def workloads(*, quick: bool) -> list[Workload]:
    """The workloads of these rows: the LoRA model, then the unfreezing stages."""
    d = _QUICK_WIDTH if quick else _WIDTH
    return [lora(d=d), *(unfreezing(k, d=d) for k in UNFREEZE_STAGES)]


def measure_lora(optimizer: str, device: torch.device, dtype: torch.dtype, settings: dict,
                 log: Callable[[str], None], *, quick: bool) -> tuple[list[dict], dict]:
    """The LoRA-shaped model's speed row (rows, reference record)."""
    return measure_group(optimizer, workloads(quick=quick)[0], device, dtype, settings, log, CANDIDATES)


def measure_unfreezing(optimizer: str, device: torch.device, dtype: torch.dtype, settings: dict,
                       log: Callable[[str], None], *, quick: bool) -> tuple[list[dict], list[dict]]:
    """One speed row per unfreezing stage (rows, reference records); a stage's ``first_step_ms`` is its
    first step, after unfreezing."""
    stages = workloads(quick=quick)[1:]
    cands, blank = start_candidates(optimizer, stages[0], device, dtype, log, CANDIDATES)
    out_rows, refs = [], []
    for previous, work in zip([None, *stages], stages):
        if previous is not None:
            fresh = [None if previous.is_trainable(i) else g for i, g in enumerate(gradients(work, device, dtype))]
            for c in list(cands):
                for p, g in zip(c.params, fresh):
                    if g is not None:
                        p.requires_grad_(True)
                c.attach(fresh)
                try:
                    c.first_step_s = wall_seconds(c.step, device, probe=c.params[-1])
                    c.settle_gradients(gradients(work, device, dtype))
                except Exception as exc:  # torch.optim.SGD(fused=True) refuses new parameters: n/a from here on
                    cands.remove(c)
                    blank[c.name].update(available=False, reason=f"after unfreezing: {error_text(exc)}")
                    log(f"  {optimizer:8} {work.name:18} {c.name:20} n/a ({blank[c.name]['reason']})")
        rows = {name: {**row, "workload": work.name} for name, row in blank.items()}
        stage_rows, ref = measure(cands, rows, optimizer, work, device, dtype, settings, log)
        out_rows += stage_rows
        refs.append(ref)
    return out_rows, refs
