"""The speed rows: every candidate of one (optimizer, workload), side by side in one process.

:func:`start_candidates` builds the candidates (n/a ones say why) and takes
their first steps; :func:`measure` times them round-robin together with the
bandwidth reference (:class:`~dml_optim.benchmark.timing.Reference`) and fills
one row per candidate:

* ``ms_per_step``: wall time (``inner`` back-to-back steps between two
  synchronizations; at least 20 on CUDA), median over the rounds, and
  ``round_ms``: the sample of each round, in order (two rows' ratio is taken
  round by round: :func:`~dml_optim.benchmark.targets.versus`);
* ``kernel_ms`` (CUDA): the device time of the step's kernels, from
  ``torch.profiler``;
* ``gbs``: the minimum bytes a step must move
  (:data:`~dml_optim.benchmark.candidates.BYTES_PER_ELEMENT`) per second, and
  ``fraction_of_reference``: the median over rounds of the step's bytes per
  second over the reference's in the same round
  (:func:`~dml_optim.benchmark.timing.paired_fraction`: the stream limit off
  CUDA, the fastest of its passes in that round; the copy on CUDA);
  ``kernel_fraction_of_reference`` (CUDA): kernel times, the step's over the
  copy's (profiled once, not in rounds);
* ``ops_per_step``: :func:`dml_optim.core.opcount.count_ops` (views excluded, a
  compiled kernel call is one op); ``optimizer_bytes``; ``first_step_ms``
  and, for ``compiled``, ``compile_s``.

The reference record (one per row) has the reference's ``reference`` (kind:
``stream``, ``copy``), ``reference_elements``, ``reference_gbs`` (the median
over rounds of the round's reference bandwidth), ``reference_ms`` (a pass of
:attr:`~dml_optim.benchmark.timing.Reference.bytes_moved` at that bandwidth:
3 elements per element for the stream limit), ``reference_passes`` (per pass:
``traffic``, median ``gbs``, ``fastest_rounds``), ``reference_fastest`` and,
on CUDA, ``reference_kernel_ms`` and ``reference_kernel_gbs``.  Its
``auto_backend`` names the row that is what ``backend="auto"`` runs
(:func:`~dml_optim.benchmark.candidates.auto_backend`): ``fused`` where
torch's fused kernel can run the buffer (the CPU, float32 or float64, plain
states), else the backend it resolves to for the workload's
size (``eager`` or ``compiled``: CUDA), or ``auto`` where the row measures a
``dml_optim auto`` candidate of its own (the frozen rows: with parameters at
several step counts, what ``auto`` runs is not the plain step's choice).
``auto_runs`` says what that ran: the same backend, or for ``auto`` what the
``dml_optim auto`` candidate's buffers ran after its timed steps
(:func:`~dml_optim.benchmark.candidates.ran`: ``fused``, ``eager``,
``compiled``, ``eager+compiled``; None where it is n/a).  Labels show
``auto_runs`` (:func:`~dml_optim.benchmark.targets.auto_label`).

:func:`measure_group` is the two for one workload.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dml_optim.benchmark.candidates import (AUTO, BYTES_PER_ELEMENT, CANDIDATES, TORCH_CANDIDATES, Candidate,
                                            auto_backend, ran, settle, start, unavailable)
from dml_optim.benchmark.common import error_text
from dml_optim.benchmark.timing import (REFERENCE_NAMES, Reference, kernel_seconds, paired_fraction, round_robin,
                                        wall_seconds)
from dml_optim.benchmark.workloads import Workload, make_params, make_values
from dml_optim.core.opcount import count_ops

__all__ = ["ROW_FIELDS", "gradients", "start_candidates", "measure", "measure_group"]

#: The fields of every speed row (None where not measured).
ROW_FIELDS = (
    "optimizer", "workload", "candidate", "available", "reason", "ms_per_step", "steps_per_s", "ratio_to_best_torch",
    "gbs", "fraction_of_reference", "kernel_ms", "kernel_gbs", "kernel_fraction_of_reference", "ops_per_step",
    "optimizer_bytes", "first_step_ms", "compile_s", "samples", "inner_steps", "round_ms", "error",
)
#: Steps the profiler records per candidate for ``kernel_ms`` (one where a step launches thousands of kernels).
_PROFILED_STEPS = 3
_MANY_OPS = 1000


def gradients(work: Workload, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """The gradients every candidate of ``work`` gets (None for frozen parameters)."""
    return make_values(work, device, dtype, seed=7, scale=1e-2, trainable_only=True)


def start_candidates(optimizer: str, work: Workload, device: torch.device, dtype: torch.dtype,
                     log: Callable[[str], None], candidates: Sequence[str] = CANDIDATES,
                     ) -> tuple[list[Candidate], dict[str, dict]]:
    """Every one of ``candidates`` that can run, its first step taken, and a row per candidate (n/a ones with
    the reason)."""
    values = make_values(work, device, dtype, seed=0, scale=0.1)
    grads = gradients(work, device, dtype)
    cands: list[Candidate] = []
    rows: dict[str, dict] = {}
    for name in candidates:
        row = dict.fromkeys(ROW_FIELDS)
        row.update(optimizer=optimizer, workload=work.name, candidate=name, available=False)
        rows[name] = row
        why = unavailable(name, device)
        if why is None:
            try:
                cands.append(start(name, optimizer, make_params(work, values), grads, device))
                row["available"] = True
            except Exception as exc:  # torch refuses fused for this device/dtype, compile failed, out of memory, ...
                why = error_text(exc)
        row["reason"] = why
        if why:
            log(f"  {optimizer:8} {work.name:18} {name:20} n/a ({why})")
    return cands, rows


def measure(cands: list[Candidate], rows: dict[str, dict], optimizer: str, work: Workload, device: torch.device,
            dtype: torch.dtype, settings: dict, log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """Time ``cands`` round-robin beside the reference; fill and return their rows, and the reference's record."""
    numel = work.trainable_numel
    for c in cands:
        if settings.get("settle", True):
            settle(c)
    ref = Reference(numel, device, dtype)
    steps = {c.name: c.step for c in cands}
    steps.update(ref.steps())
    timed = round_robin(steps, lambda fn, inner: wall_seconds(fn, device, inner, ref.probe), settings,
                        {c.name: c.first_step_s for c in cands})
    ref_bps, ref_fields = ref.summary(timed)
    elem = torch.empty((), dtype=dtype).element_size()
    step_bytes = BYTES_PER_ELEMENT[optimizer] * elem * numel
    for c in cands:
        row = rows[c.name]
        s = timed[c.name]["seconds"]
        row.update(ms_per_step=s * 1e3, steps_per_s=1 / s, gbs=step_bytes / s / 1e9,
                   fraction_of_reference=paired_fraction(timed[c.name]["round_seconds"], step_bytes, ref_bps),
                   first_step_ms=c.first_step_s * 1e3, samples=timed[c.name]["samples"], inner_steps=timed[c.name]["inner"],
                   round_ms=[t * 1e3 for t in timed[c.name]["round_seconds"]])
        row["compile_s"] = max(0.0, c.first_step_s - s) if c.name == "dml_optim compiled" else None
        try:
            row["optimizer_bytes"] = c.optimizer_bytes()
            row["ops_per_step"] = count_ops(c.step)
        except Exception as exc:  # recorded; the row keeps its times
            row["error"] = error_text(exc)
    ref_kernel = None
    if device.type == "cuda" and settings["kernel_time"]:
        ref_kernel = _kernel(ref.passes["copy"], None, {})
        for c in cands:
            k = _kernel(c.step, rows[c.name]["ops_per_step"], rows[c.name])
            if k is not None:
                rows[c.name].update(kernel_ms=k * 1e3, kernel_gbs=step_bytes / k / 1e9)
                if ref_kernel is not None:
                    rows[c.name]["kernel_fraction_of_reference"] = ref_kernel / k * step_bytes / ref.bytes_moved
    torch_ms = [rows[n]["ms_per_step"] for n in TORCH_CANDIDATES if rows[n]["ms_per_step"] is not None]
    for row in rows.values():
        if row["ms_per_step"] is not None and torch_ms:
            row["ratio_to_best_torch"] = min(torch_ms) / row["ms_per_step"]
    reference = {
        "optimizer": optimizer, "workload": work.name, "reference": ref.kind, "reference_elements": ref.numel,
        **ref_fields,
        "reference_kernel_ms": None if ref_kernel is None else ref_kernel * 1e3,
        "reference_kernel_gbs": None if ref_kernel is None else ref.bytes_moved / ref_kernel / 1e9,
        # (what auto runs in a long run: a buffer it compiles after running eagerly for a while is compiled)
        "auto_backend": "auto" if AUTO in rows else auto_backend(optimizer, device, dtype, numel),
        "rounds": min(t["samples"] for t in timed.values()),
        "trainable_elements": numel,
    }
    mine = next((c for c in cands if c.name == AUTO), None)
    reference["auto_runs"] = (ran(mine.opt) if mine is not None else None) if AUTO in rows else reference["auto_backend"]
    auto = rows.get(f"dml_optim {reference['auto_backend']}") or {"ms_per_step": None}
    log(f"  {optimizer:8} {work.name:18} dml_optim (auto: {reference['auto_runs'] or 'n/a'}) "
        f"{_ms(auto['ms_per_step'])}, best torch.optim "
        f"{_ms(min(torch_ms) if torch_ms else None)}, {REFERENCE_NAMES[ref.kind]} "
        f"{ref_fields['reference_gbs']:.1f} GB/s (fastest: {ref_fields['reference_fastest']})")
    return list(rows.values()), reference


def _kernel(step: Callable[[], object], ops: int | None, row: dict) -> float | None:
    """Kernel seconds per step, or None with the error recorded in ``row`` (the profiler is optional)."""
    try:
        return kernel_seconds(step, 1 if ops is not None and ops > _MANY_OPS else _PROFILED_STEPS)
    except Exception as exc:
        row["error"] = error_text(exc)
        return None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def measure_group(optimizer: str, work: Workload, device: torch.device, dtype: torch.dtype, settings: dict,
                  log: Callable[[str], None], candidates: Sequence[str] = CANDIDATES) -> tuple[list[dict], dict]:
    """Build and time every one of ``candidates`` on (``optimizer``, ``work``)."""
    cands, rows = start_candidates(optimizer, work, device, dtype, log, candidates)
    return measure(cands, rows, optimizer, work, device, dtype, settings, log)
