"""Optimizer-step benchmark: dml_optim beside torch.optim, measured side by side in one process.

``dml-optim bench`` and ``bench/run.py`` run it; ``bench/README.md`` gives
the method, the rows and the fields of the JSON document.  One module per job:

* :mod:`~dml_optim.benchmark.workloads`: what is stepped over (model shapes,
  the LoRA model, unfreezing stages) and its tensors;
* :mod:`~dml_optim.benchmark.candidates`: the optimizers compared (dml_optim's
  eager, compiled and fused backends, torch.optim's for-loop, foreach and
  fused), built through the registry, the memory they hold, and what
  ``backend="auto"`` runs;
* :mod:`~dml_optim.benchmark.timing`: wall, CUDA-event and kernel time,
  round-robin sampling, the bandwidth reference (the stream limit: the
  fastest of in-place streaming passes, add and torch's fused SGD and Adam
  kernels at lr=0, each round; CUDA: copy), fractions of it paired by round;
* the rows: :mod:`~dml_optim.benchmark.speed` (candidates side by side;
  ops per step from :func:`dml_optim.core.opcount.count_ops`),
  :mod:`~dml_optim.benchmark.frozen` (LoRA, gradual unfreezing),
  :mod:`~dml_optim.benchmark.host` (host work per parameter, per ``checks``
  mode; compiled instances), :mod:`~dml_optim.benchmark.memory` (peak at construction),
  :mod:`~dml_optim.benchmark.graphs` (capturable steps in a CUDA graph),
  :mod:`~dml_optim.benchmark.lowbit` (8-bit and 4-bit AdamW state),
  :mod:`~dml_optim.benchmark.nonepattern` (``None`` gradients changing
  every step), :mod:`~dml_optim.benchmark.construction` (construction +
  first step);
* :mod:`~dml_optim.benchmark.targets`: the issues' targets, PASS/MISS, each
  row's stored beside it;
* :mod:`~dml_optim.benchmark.report`: tables, summary, the JSON file;
* :mod:`~dml_optim.benchmark.run`: the plan of a run and running it.

May import: core, dml, backends, optimizers, training, precision, job, standin, top.
"""

from dml_optim.benchmark.candidates import CANDIDATES, OPTIMIZERS
from dml_optim.benchmark.report import default_output_path, format_report, format_summary, write_json
from dml_optim.benchmark.run import ROWS, Plan, default_rows, make_plan, run_plan
from dml_optim.benchmark.targets import check_targets, record_targets
from dml_optim.benchmark.workloads import QUICK_WORKLOADS, Workload, default_workloads, workload

__all__ = [
    "CANDIDATES", "OPTIMIZERS", "ROWS", "QUICK_WORKLOADS", "Workload", "Plan", "workload", "default_workloads",
    "default_rows", "make_plan", "run_plan", "check_targets", "record_targets", "format_report", "format_summary",
    "default_output_path", "write_json",
]
