"""The host-work rows: what a step costs the CPU per parameter, and per live compiled instance.

* **Host work** (:func:`measure_host_work`), on the CPU with one thread: a
  step over 2,000 parameters of 16 elements against a step over one tensor
  of 32,000 elements (the same elements, so the difference is per-parameter
  host work).  With the default backend (``auto``: torch's fused kernel on
  the CPU, ``backend`` in the row says what it ran) the 2,000 tensors step
  with each ``checks`` mode: ``"full"`` (the default: two storage use counts
  per flat buffer and every parameter's gradient identity and data pointer),
  ``"refs"`` (the two counts alone, whatever the number of parameters) and
  ``"fast"`` (the counts and the first and last parameter of each buffer).
  Beside them, the eager op chain (what DirectML runs) with the default
  checks, 2,000 tensors and one: the ``eager_`` fields.  Ratios ``many /
  one``, each over the one-tensor step of the same backend.  **The target,
  at most 3x, is the default's** (``ratio_<checks>``, ``checks`` the row's
  default: ``"full"``; documents of 2026-11 recorded ``"refs"``, the default
  then); the other modes and the eager chain are reported beside it, not
  targets.  The ops each step dispatches are counted too
  (:func:`dml_optim.core.opcount.count_ops`): the same for the 2,000 tensors as
  for the one, so the difference is host work, not kernels.  The one
  tensor's gradient (a tensor of its own, 32,000 elements) is read in place
  by the fused step, which plans that step anew each time, while the 2,000
  small gradients are gathered into the flat buffer at the first step and
  later steps repeat its plan: the fused ratio can be below 1.  (Documents
  before the ``"refs"`` mode hold the eager backend's ``"full"`` and
  ``"fast"`` only, each with a target.)
* **Instances** (:func:`measure_instances`): 12 compiled Adam optimizers
  built one after another over the same shapes (epsilon cycling through
  three values: a tensor input of the kernel, not a constant), all kept
  alive; instance 2 and instance 12 are timed side by side.  The ratio
  ``12th / 2nd`` must stay at most 1.1: a later instance must not pay for
  the earlier ones (guards, recompiles).  Dynamo's frame and graph counts
  are recorded.
"""

from __future__ import annotations

from typing import Callable

import torch

from dml_optim.benchmark.candidates import AUTO, ran, start
from dml_optim.benchmark.timing import round_robin, wall_seconds
from dml_optim.benchmark.workloads import Workload, make_params, make_values, workload
from dml_optim.core.opcount import count_ops

__all__ = ["HOST_WORK_LIMIT", "HOST_CHECKS", "DEFAULT_CHECKS", "INSTANCES_LIMIT", "measure_host_work",
           "measure_instances"]

#: Target: with the default ``checks`` and backend, a step over 2,000 x 16 elements costs at most this many times
#: a step over one 32,000-element tensor.
HOST_WORK_LIMIT = 3.0
#: The ``checks`` modes the row measures with the default backend; the first is the default, the target's.
HOST_CHECKS = ("full", "refs", "fast")
DEFAULT_CHECKS = HOST_CHECKS[0]
#: Target: the 12th compiled instance's step costs at most this many times the 2nd's.
INSTANCES_LIMIT = 1.1
_INSTANCES = 12
_EPSILONS = (1e-8, 1e-6, 1e-4)


def _candidate(name: str, optimizer: str, work: Workload, device: torch.device, dtype: torch.dtype, **options):
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    grads = make_values(work, device, dtype, seed=7, scale=1e-2)
    return start(name, optimizer, make_params(work, values), grads, device, **options)


def measure_host_work(optimizer: str, settings: dict, log: Callable[[str], None]) -> dict:
    """The host-work row of ``optimizer`` (CPU, one thread): the default backend with each of
    :data:`HOST_CHECKS`, and the eager chain with the default checks."""
    cpu = torch.device("cpu")
    many = Workload("2000x16", ((16,),) * 2000, "2,000 tensors of 16 elements")
    one = Workload("1x32000", ((32000,),), "one tensor of 32,000 elements")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # (the default's candidate is built without the option: what a user gets)
        cands = {f"many, checks={c}": _candidate(AUTO, optimizer, many, cpu, torch.float32,
                                                 **({} if c == DEFAULT_CHECKS else {"checks": c})) for c in HOST_CHECKS}
        cands["one tensor"] = _candidate(AUTO, optimizer, one, cpu, torch.float32)
        cands["eager many"] = _candidate("dml_optim eager", optimizer, many, cpu, torch.float32)
        cands["eager one"] = _candidate("dml_optim eager", optimizer, one, cpu, torch.float32)
        timed = round_robin({k: c.step for k, c in cands.items()}, lambda fn, inner: wall_seconds(fn, cpu, inner),
                            settings)
        ops = {k: count_ops(c.step) for k, c in cands.items()}
    finally:
        torch.set_num_threads(threads)
    us = {k: t["seconds"] * 1e6 for k, t in timed.items()}
    backend = ran(cands[f"many, checks={DEFAULT_CHECKS}"].opt)
    default = cands[f"many, checks={DEFAULT_CHECKS}"].opt.checks  # (the library's default, as the option reads)
    row = {"optimizer": optimizer, "backend": backend, "checks": default, "threads": 1, "limit": HOST_WORK_LIMIT}
    for c in HOST_CHECKS:
        row[f"us_many_{c}"] = us[f"many, checks={c}"]
    row["us_one"] = us["one tensor"]
    for c in HOST_CHECKS:
        row[f"ratio_{c}"] = us[f"many, checks={c}"] / us["one tensor"]
    for c in HOST_CHECKS:
        row[f"ops_many_{c}"] = ops[f"many, checks={c}"]
    row["ops_one"] = ops["one tensor"]
    row.update(eager_us_many=us["eager many"], eager_us_one=us["eager one"],
               eager_ratio=us["eager many"] / us["eager one"], eager_ops_many=ops["eager many"], eager_ops_one=ops["eager one"],
               samples=min(t["samples"] for t in timed.values()))
    log(f"  host work {optimizer} ({backend}): 2000x16 " + ", ".join(f"{row[f'us_many_{c}']:.0f} us (checks={c})"
                                                                     for c in HOST_CHECKS)
        + f"; 1x32000 {row['us_one']:.0f} us: " + " / ".join(f"{row[f'ratio_{c}']:.2f}x" for c in HOST_CHECKS)
        + f"; eager (checks={DEFAULT_CHECKS}) {row['eager_us_many']:.0f} / {row['eager_us_one']:.0f} us: "
        f"{row['eager_ratio']:.2f}x")
    return row


def measure_instances(device: torch.device, dtype: torch.dtype, settings: dict, log: Callable[[str], None], *,
                      quick: bool) -> dict:
    """The instances row: 12 compiled Adam instances over ``many-small-256`` (``many-small-16`` with ``quick``)."""
    from torch._dynamo.utils import counters

    work = workload("many-small-16" if quick else "many-small-256")
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    cands = [_candidate("dml_optim compiled", "adam", work, device, dtype, epsilon=_EPSILONS[i % len(_EPSILONS)])
             for i in range(_INSTANCES)]
    second, last = cands[1], cands[-1]
    timed = round_robin({"2nd": second.step, "12th": last.step},
                        lambda fn, inner: wall_seconds(fn, device, inner, last.params[-1]), settings)
    row = {"optimizer": "adam", "backend": "compiled", "workload": work.name, "instances": _INSTANCES,
           "limit": INSTANCES_LIMIT, "first_step_ms": [c.first_step_s * 1e3 for c in cands],
           "ms_2nd": timed["2nd"]["seconds"] * 1e3, "ms_12th": timed["12th"]["seconds"] * 1e3,
           "ratio": timed["12th"]["seconds"] / timed["2nd"]["seconds"],
           "frames_compiled": counters["frames"]["total"] - frames, "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
           "samples": timed["2nd"]["samples"]}
    log(f"  instances: 2nd {row['ms_2nd']:.3f} ms, 12th {row['ms_12th']:.3f} ms ({row['ratio']:.2f}x); "
        f"{row['graphs_compiled']} graph(s), {row['frames_compiled']} frame(s) compiled")
    return row
