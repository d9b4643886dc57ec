"""Write the generated tables of README.md and of the documentation site (``docs/``) from committed results.

Usage::

    python tools/readme_tables.py                 # rewrite every generated table, in README.md and docs/
    python tools/readme_tables.py --check         # exit 1, with a diff, where a file differs
    python tools/readme_tables.py --record-audit  # re-run the audits, write bench/results/audit-<UTC date>.json

A generated table sits between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in README.md or a page under
``docs/``; :data:`TABLES` maps each NAME to the function that writes it, and every file holding the
pair gets that text, so a table the README and the site share is written once.  Adding a table is a
function, an entry in :data:`TABLES` and its marker pair where it goes.  The sources: the documents named
in :data:`SOURCES` (one ``dml-optim audit --json`` output per row of :data:`AUDIT_ROWS`, and
``dml-optim bench --out bench/results/NAME.json`` runs), the committed ``dml-optim compare`` report
(``docs/compare-report.md``), and, for the tables in :data:`MEASURED`, a measurement made here
(``dml_optim.precision.memory``, seconds).  ``tests/test_readme_tables.py`` checks that the files hold
what this script writes (``--skip-measured``: the measured tables only for being the same in every file;
``tests/test_memory_table.py`` measures them).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dml_optim, also when it is not installed

from dml_optim.benchmark import default_workloads, report  # noqa: E402
from dml_optim.benchmark.targets import auto_label, reference, speed_row, versus  # noqa: E402
from dml_optim.benchmark.timing import reference_name  # noqa: E402
from dml_optim.benchmark.wholemem import NOT_ON_DIRECTML  # noqa: E402
from dml_optim.benchmark.workloads import FROZEN_PREFIXES  # noqa: E402

README = ROOT / "README.md"
#: The committed documents the tables are written from (paths relative to the repository root).
SOURCES = {
    "audit": "bench/results/audit-2026-11-28.json",
    "cpu": "bench/results/cpu-2026-11-29-4.json",
    "cuda": "bench/results/cuda-2026-11-23.json",
    "lowbit": "bench/results/cpu-lowbit-2026-11-29-factors-1.json",
    "memory": "bench/results/memory-2026-12-07.json",
    "fits": "bench/results/fits-2026-12-07.json",
}
#: (optimizer, model) per row of the audit table.
AUDIT_ROWS = (
    ("adam", "resnet50"), ("dml-adam", "resnet50"), ("adamw", "resnet50"), ("adagrad", "resnet50"),
    ("momentum", "resnet50"), ("adam", "bert-base-uncased"), ("adam", "many-small"),
)
#: Rows of the benchmark tables, in order.
_SPEED_WORKLOADS = {"cpu": ("resnet50", "bert-base-uncased", "gpt2", "many-small", "one-256k", "one-1m", "one-64m"),
                    "cuda": ("resnet50", "bert-base-uncased", "gpt2", "one-256m", "many-small")}
_OPTIMIZERS = ("adam", "adamw", "adagrad", "momentum")
#: Paragraphs are wrapped at this width.
_WIDTH = 100


def _fill(text: str) -> str:
    """``text`` wrapped at :data:`_WIDTH`, never inside a word or a command (``dml-optim``)."""
    return textwrap.fill(text, _WIDTH, break_on_hyphens=False, break_long_words=False)


# -- the audit table ---------------------------------------------------------------------------------------


def record_audit(out: Path) -> None:
    """Run ``dml-optim audit --json`` (this checkout's) for every row of :data:`AUDIT_ROWS`; write ``out``."""
    rows = []
    for optimizer, model in AUDIT_ROWS:
        print(f"dml-optim audit --optimizer {optimizer} --model {model} --json", flush=True)
        proc = subprocess.run([sys.executable, "-m", "dml_optim", "audit", "--optimizer", optimizer, "--model", model,
                               "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout))
    version = subprocess.run([sys.executable, "-c", "import torch, dml_optim; print(torch.__version__, dml_optim.__version__)"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    doc = {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "dml-optim audit --optimizer OPTIMIZER --model MODEL --json", "torch": version[0],
           "dml_optim": version[1], "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT)}")


def _short(name: str) -> str:
    """``dml_optim.Adam`` -> ``Adam``; ``torch.optim.Adam (foreach)`` -> ``torch.optim.Adam``."""
    return name.split(" (")[0].removeprefix("dml_optim.")


def _fallbacks(side: dict) -> str:
    names = ", ".join(f"`{f['op'].removeprefix('aten::')}`" for f in side["fallbacks"])
    return f"{side['fallback_ops']:,}" + (f" ({names})" if names else "")


def audit_table(doc: dict[str, Any], source: str) -> str:
    """The audit table and its note."""
    lines = ["| model (tensors, parameters) | optimizer | ops per step: dml_optim / torch.optim | "
             "CPU fallbacks per step: dml_optim / torch.optim | allocations per step: dml_optim / torch.optim | "
             "bytes moved per parameter: dml_optim / torch.optim (with its fallbacks' bus trips) | least a step moves |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        ours, theirs = r["ours"], r["torch"]
        lines.append(f"| {r['model']} ({r['tensors']:,}, {r['parameters'] / 1e6:.1f}M) | `{_short(ours['optimizer'])}` vs "
                     f"`{_short(theirs['optimizer'])}` | {ours['total_ops']:,} / {theirs['total_ops']:,} | "
                     f"{_fallbacks(ours)} / {_fallbacks(theirs)} | {ours['allocations']:,} / {theirs['allocations']:,} | "
                     f"{ours['bytes_moved_per_param']:.0f} / {theirs['bytes_moved_per_param']:.0f} "
                     f"({theirs['bytes_with_fallbacks_per_param']:.0f}) | {ours['least_bytes_per_param']:.0f} |")
    syncs = sum(r[side]["host_syncs"] for r in doc["rows"] for side in ("ours", "torch"))
    sync_note = ("Neither side makes a host sync in these steps." if syncs == 0
                 else f"{syncs} host syncs in these steps (see the JSON).")
    note = (f"(`dml-optim audit --optimizer NAME --model MODEL`: one step after a warm-up step, torch {doc['torch']}, "
            f"recorded in `{source}` by `python tools/readme_tables.py --record-audit`, which writes this table. "
            f"{sync_note} An allocation is a new tensor the step creates. Bytes moved: per op, each distinct tensor "
            f"read and each written (an in-place op's tensor both), summed over the step; an op that falls back to "
            f"the CPU on DirectML also copies its tensors over the bus and back, counted in parentheses. The least "
            f"a step moves: its parameters, gradients and states read once and the updated ones written once.)")
    return "\n".join(lines + ["", _fill(note)])


# -- the benchmark tables ----------------------------------------------------------------------------------


def _row(doc: dict, optimizer: str, work: str, candidate: str) -> dict | None:
    """The measured speed row, or None (absent or n/a)."""
    row = speed_row(doc, optimizer, work, candidate)
    return row if row is not None and row["ms_per_step"] is not None else None


def _ms(row: dict | None, key: str = "ms_per_step") -> str:
    if row is None or row[key] is None:
        return "n/a"
    value = row[key]
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _mb(row: dict | None) -> str:
    return "n/a" if row is None or row["optimizer_bytes"] is None else f"{row['optimizer_bytes'] / 2**20:,.0f}"


def _machine(doc: dict, source: str) -> str:
    m = doc["machine"]
    if "gpu" in m:
        where = f"an {m['gpu']} ({m.get('gpu_memory_gib')} GiB), torch {m['torch']}, CUDA {m.get('cuda')}, triton {m.get('triton', 'n/a')}"
    else:
        load = ""
        if "loadavg_start" in m and "loadavg_end" in m:
            load = f", load average {m['loadavg_start'][0]:.1f} at the start and {m['loadavg_end'][0]:.1f} at the end"
        where = (f"a {m['cpu_count']}-vCPU {m['processor']} Linux VM (\"{m.get('cpu_model', 'n/a')}\", "
                 f"{m.get('memory_gib', 'n/a')} GiB, no GPU), torch {m['torch']}, {m['torch_threads']} "
                 f"thread{'' if m['torch_threads'] == 1 else 's'}{load}")
    minutes = round(doc["elapsed_s"] / 60)
    return _fill(f"Measured on {where}, {doc['dtype']}, {doc['created'][:10]}, in {minutes} "
                         f"minute{'' if minutes == 1 else 's'} (`{source}`).")


def _command(doc: dict) -> str:
    """The command line that measures ``doc``'s rows again (thread count and workloads as recorded)."""
    works = [w["name"] for w in doc["workloads"] if not w["name"].startswith(FROZEN_PREFIXES)]
    named = "" if tuple(works) == default_workloads(doc["device"].split(":")[0]) else " --workloads " + " ".join(works)
    return f"OMP_NUM_THREADS={doc['machine']['torch_threads']} dml-optim bench{named}"


def _row_targets(doc: dict) -> bool:
    """Whether ``doc`` stores each speed and frozen row's targets beside it (the committed documents of 2026-11-23 do not)."""
    return any("targets" in r for r in doc["references"])


def _targets_cell(ref: dict, shown: set[str]) -> list[str]:
    """The last cell of a speed or frozen row: its targets, where the document stores them beside it."""
    return [report.target_cells(ref["targets"], shown)] if "targets" in ref else []


def _speed_table(doc: dict, device: str, shown: set[str]) -> list[str]:
    cuda = device == "cuda"
    ref_name = reference_name(doc).removeprefix("the ")
    header = ["workload", "optimizer", "dml_optim ms (backend `auto` picks)"]
    header += ["dml_optim kernel ms", "torch fused kernel ms"] if cuda else []
    header += ["torch fused ms", "torch foreach ms", "dml_optim vs torch fused", "dml_optim vs best torch.optim",
               f"dml_optim % of {ref_name}", "optimizer MB: dml_optim / torch fused"]
    targets = ["targets"] if _row_targets(doc) else []
    align = ["---", "---"] + ["---:"] * (len(header) - 2) + ["---"] * len(targets)
    lines = ["| " + " | ".join(header + targets) + " |", "|" + "|".join(align) + "|"]
    for work in _SPEED_WORKLOADS[device]:
        for optimizer in _OPTIMIZERS:
            ref = reference(doc, optimizer, work)
            if ref is None:
                continue
            mine = _row(doc, optimizer, work, f"dml_optim {ref['auto_backend']}")
            fused, foreach = _row(doc, optimizer, work, "torch fused"), _row(doc, optimizer, work, "torch foreach")
            if mine is None:
                continue
            cells = [work, optimizer, f"{_ms(mine)} ({auto_label(ref)})"]
            cells += [_ms(mine, "kernel_ms"), _ms(fused, "kernel_ms")] if cuda else []
            cells += [_ms(fused), _ms(foreach), report.ratio_cell(*versus(doc, mine, "torch fused")), f"{mine['ratio_to_best_torch']:.2f}x",
                      f"{100 * mine['fraction_of_reference']:.0f}%", f"{_mb(mine)} / {_mb(fused)}", *_targets_cell(ref, shown)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _frozen_table(doc: dict, shown: set[str]) -> list[str]:
    works = [w["name"] for w in doc["workloads"] if w["name"].startswith(FROZEN_PREFIXES)]
    targets = _row_targets(doc)
    lines = ["| model (trainable / all elements) | optimizer | dml_optim ms (`auto`) | torch fused ms | torch foreach ms | "
             "dml_optim vs torch fused | ops per step: dml_optim / torch foreach | state MB: dml_optim / torch fused | "
             "first step ms: dml_optim / torch fused |" + (" targets |" if targets else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if targets else "")]
    sizes = {w["name"]: w for w in doc["workloads"]}
    for work in works:
        for optimizer in _OPTIMIZERS:
            ref = reference(doc, optimizer, work)
            mine = _row(doc, optimizer, work, f"dml_optim {ref['auto_backend']}") if ref else None
            if mine is None:
                continue
            fused, foreach = _row(doc, optimizer, work, "torch fused"), _row(doc, optimizer, work, "torch foreach")
            w = sizes[work]
            lines.append(f"| {work} ({w['trainable_elements']:,} / {w['elements']:,}) | {optimizer} | {_ms(mine)} "
                         f"({auto_label(ref)}) | {_ms(fused)} | {_ms(foreach)} | "
                         f"{report.ratio_cell(*versus(doc, mine, 'torch fused'))} | {mine['ops_per_step']} / "
                         f"{'n/a' if foreach is None else foreach['ops_per_step']} | {_mb(mine)} / {_mb(fused)} | "
                         f"{_ms(mine, 'first_step_ms')} / {_ms(fused, 'first_step_ms')} |"
                         + "".join(f" {c} |" for c in _targets_cell(ref, shown)))
    return lines


def _not_measured(doc: dict) -> list[str]:
    return [f"* {n['what']}: {n['reason']}" for n in doc.get("not_measured", [])]


def _reference_note(doc: dict) -> list[str]:
    if reference_name(doc) == "the triad":  # a document recorded before the in-place add reference
        return ["keeps no full-size scratch. Effective bandwidth above 100% of the triad is real: the triad pays a",
                "write-allocate on its output, in-place updates do not. `bench/README.md` explains every row and field."]
    if reference_name(doc) == "the in-place add":  # a document recorded before the stream limit
        return ["keeps no full-size scratch. The CPU's bandwidth reference is an in-place add (`a += s*b`), which, like",
                "an optimizer step, writes back what it read: no write-allocate. `bench/README.md` explains every row and field."]
    return ["keeps no full-size scratch. The CPU's bandwidth reference is the stream limit: the fastest, round by round,",
            "of in-place streaming passes (the add `a += s*b`, torch's fused SGD and Adam kernels with `lr=0`), which",
            "write back what they read like an optimizer step; a row's % pairs each round with that round's limit.",
            "`bench/README.md` explains every row and field."]


def _fused(doc: dict) -> bool:
    """Whether ``doc`` measured the fused backend (``backend="auto"``'s choice on the CPU since it was added;
    the committed documents of 2026-11-25 and before did not): the notes then say so."""
    return "dml_optim fused" in doc.get("candidates", ())


def _host_note(doc: dict) -> list[str]:
    """The paragraph before the host, memory and instances tables."""
    if not any("ratio_refs" in r for r in doc.get("host_work", [])):  # (a document before checks="refs")
        return ["Host work per parameter (eager, one thread: the same elements as 2,000 tensors or as one, so the",
                "difference is what the host does per parameter; `checks=\"fast\"` compares only the first and last",
                "parameter of each buffer, see [Options](guide/options.md)), the memory peak while an optimizer is built",
                "(resident set: approximate), and 12 compiled instances alive at once:"]
    default = doc["host_work"][0]["checks"]
    modes = {"full": "two storage use counts per buffer and every parameter's gradient and data pointer",
             "refs": "two storage use counts per buffer, alone",
             "fast": "the two counts and the first and last parameter of each buffer"}
    described = [f"`\"{default}\"` (the default, the target's: {modes[default]})"] + [
        f"`\"{m}\"` ({modes[m]})" for m in report.host_modes(default)[1:]]
    return [_fill("Host work per parameter (one thread: the same elements as 2,000 tensors or as one, so the difference "
                  "is what the host does per parameter), with the default backend (what `auto` ran) and each `checks` "
                  f"mode: {', '.join(described[:-1])} and {described[-1]}, see [Options](guide/options.md); beside them the "
                  "eager op chain that DirectML runs, with the default checks. Then the memory peak while an optimizer "
                  "is built (resident set: approximate), and 12 compiled instances alive at once:")]


def _auto_note(cpu: dict) -> list[str]:
    """The paragraph after both runs: what ``backend="auto"`` runs, and the reference."""
    if not _fused(cpu):  # (a CPU document before the fused backend)
        return ["`auto` compiles buffers from 4M elements on the CPU and 1M on CUDA; a CPU buffer from 16k elements starts",
                "eager and compiles once its eager steps have taken 5 s (the rows show that long-run choice; always eager",
                "on DirectML). A first compile costs about 5 s per process on this VM with inductor's disk cache warm, 20 s",
                "cold. The compiled kernel reads and writes each buffer once (Adam: 28 bytes per parameter) and",
                *_reference_note(cpu)]
    return [_fill("On the CPU `auto` runs torch's own fused kernel (`torch._fused_adamw_` and its kin) on the flat "
                  "buffers (float32 and float64 buffers with plain states: nothing to compile); otherwise it compiles "
                  "buffers from 4M elements on the CPU and 1M on CUDA, a CPU buffer from 16k elements starting eager and "
                  "compiling once its eager steps have taken 5 s (the rows show that long-run choice; always eager on "
                  "DirectML). A first compile costs about 5 s per process on this VM with inductor's disk cache warm, "
                  "20 s cold. Each of the fused and compiled kernels reads and writes each buffer once (Adam: 28 bytes "
                  "per parameter) and"),
            *_reference_note(cpu)]


def _blocks(*blocks: list[str]) -> list[str]:
    """The non-empty ``blocks``, each followed by a blank line."""
    return [line for block in blocks if block for line in (*block, "")]


_EAGER_BACKWARD = ("; then the three loops there with a real `backward()` (the same models' tensor counts, 16 elements "
                   "each, so the iteration's time is host time; the post-accumulate-grad hooks that move fresh gradients "
                   "into the flat buffer run inside it), beside torch fused and torch's for-loop AdamW, for information:")


def _new_rows(doc: dict, shown: set[str]) -> list[str]:
    """The None-pattern and construction tables with their note, then the loop tables (the CPU loops, DirectML's
    eager path) with theirs, each where ``doc`` has them (the committed documents of 2026-11-23 have none, those
    before 2026-11-28 no loops); their targets' names go to ``shown``."""
    tables = [report.nonepattern_table(doc, shown), report.construction_table(doc, shown)]
    loops = [report.loops_table(doc, shown), report.eager_loops_table(doc, shown)]
    cold = ("(any kernel already compiled), and the cold first one (with any compile: `fused` compiles nothing; the "
            "ms column says what `auto` ran) apart:" if _fused(doc) else
            "with the kernel already compiled, and the cold first one (with the compile) apart:")
    return [*([_fill("None gradients: at each step a seeded random 70% of 40 tensors of 128 x 128 have a gradient and the "
                  "others `None`, the pattern changing every step (64 patterns, cycled), beside steady steps with every "
                  "gradient, assigned the same way; medians (fastest-slowest sample), ops per step over a cycle. "
                  "Construction: 16 Linear(512, 512) layers with gradients (not timed), then the optimizer's construction "
                  "and first step, dml_optim's defaults beside torch fused: the median of fresh optimizers " + cold),
               "", *_blocks(*tables)] if any(tables) else []),
            *([_fill("The loops people run (one thread, AdamW): a training loop's optimizer work around `backward()` "
                     "(gradients simulated identically for both), `zero_grad()` then `step()`; `lambdalr`: a `LambdaLR` "
                     "changing lr every step; `none+lambdalr`: `zero_grad(set_to_none=True)`, fresh gradient tensors every "
                     "step, as accelerate and transformers' Trainer run. DirectML's path: `backend=\"eager\"` on the CPU "
                     "with 16-element tensors, host time per step (what DirectML's dispatch pays on top of its kernels)"
                     + (_EAGER_BACKWARD if any(r.get("loops") for r in doc.get("loops_eager") or []) else ":")),
               "", *_blocks(*loops)] if any(loops) else [])]


def _targets_block(doc: dict, shown: set[str]) -> list[str]:
    """The targets not already in a row's table (all of them for a document that stores none beside its rows)."""
    if not shown:
        return ["Targets:", "", *_blocks(report.targets_table(doc))]
    counts = {s: sum(t["status"] == s for t in doc["targets"]) for s in ("PASS", "MISS", "not measured")}
    rest = [t for t in doc["targets"] if t["target"] not in shown]
    return [_fill(f"Targets: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['not measured']} not measured in all. "
                  "A row's targets are in its table's last column; the others:"), "",
            *_blocks(report.targets_table({"targets": rest}))]


def bench_section(cpu: dict, cuda: dict) -> str:
    """The benchmark section: the CPU run, then the CUDA run, each with its targets (those of a row beside it,
    where the document stores them so; the rest after)."""
    shown_cpu: set[str] = set()
    shown_cuda: set[str] = set()
    cpu_rows = [_speed_table(cpu, "cpu", shown_cpu), _frozen_table(cpu, shown_cpu), _new_rows(cpu, shown_cpu)]
    cuda_rows = [_speed_table(cuda, "cuda", shown_cuda), _frozen_table(cuda, shown_cuda), _new_rows(cuda, shown_cuda)]
    lines = [
        _machine(cpu, SOURCES["cpu"]),
        _fill(f"Candidates are measured round-robin in one process, medians after warm-up; `{_command(cpu)}` "
                      "reproduces it (`--out bench/results/NAME.json` records a run there). The VM is shared: single "
                      "figures vary between runs (the same pair's ratio moved by ±7% between quiet runs; with two threads, "
                      "OpenMP kernels slow several-fold whenever other work runs), so compare candidates within a run. "
                      "A ratio of two candidates is the median of the ratios of the rounds (a round times each "
                      "candidate once, so a slow period slows both sides of it), followed by its quartiles over the "
                      "rounds where the run recorded them: where they straddle a target's line, the run cannot tell "
                      "the two apart."),
        "",
        *_blocks(cpu_rows[0]),
        "Frozen parameters (LoRA: 16 frozen 512x512 Linear layers, each with a trainable rank-8 adapter; gradual",
        "unfreezing: 16 Linear(512, 512) layers, the top 1, 4, then 16 trainable; `model.parameters()` given to the",
        "optimizer; the first step of an unfreezing stage is the one after unfreezing):",
        "",
        *_blocks(cpu_rows[1]),
        *cpu_rows[2],
        *_host_note(cpu),
        "",
        *_blocks(report.host_table(cpu), report.memory_table(cpu), report.instances_table(cpu)),
        "Not measured on the CPU:",
        "",
        *_blocks(_not_measured(cpu)),
        *_targets_block(cpu, shown_cpu),
        _machine(cuda, SOURCES["cuda"]),
        "Wall time: at least 20 back-to-back steps and one `torch.cuda.synchronize()`; kernel time: the step's",
        "kernels in `torch.profiler`; copy: a 1 GiB device-to-device `copy_`, measured in the same rounds.",
        "",
        *_blocks(*cuda_rows[:2]),
        *cuda_rows[2],
        "Many small tensors with `capturable=True`, one `step()` captured in a CUDA graph and replayed, beside",
        "plain steps (CUDA events); 12 compiled instances alive at once; the memory peak while an optimizer is",
        "built (`max_memory_allocated`):",
        "",
        *_blocks(report.graph_table(cuda), report.instances_table(cuda), report.memory_table(cuda)),
        *_targets_block(cuda, shown_cuda),
        *_auto_note(cpu),
    ]
    return "\n".join(lines)


# -- the headline tables (README and site) ------------------------------------------------------------------

#: (workload, optimizer) per row of the headline speed table.
_HEADLINE_SPEED = tuple((w, o) for w in ("resnet50", "bert-base-uncased", "gpt2", "many-small") for o in ("adam", "adamw"))
#: The configurations of the headline precision table, in its order.
_HEADLINE_PRECISION = ("fp32", "fp16", "fp16-master", "fp16-kahan", "fp16-sr", "fp16-sr-8bit", "bf16", "bf16-sr",
                       "bf16-kahan", "bf16-sr-8bit", "fp32-8bit", "fp32-4bit")
#: The compare configuration that is DirectML's lean configuration (the recommended one).
_DIRECTML_LEAN = "fp16-sr-8bit"
COMPARE_REPORT = "docs/compare-report.md"


def _speed_cells(doc: dict, work: str, optimizer: str) -> list[str]:
    """``dml_optim ms / torch fused ms`` and the ratio of the two, for what ``backend="auto"`` runs."""
    ref = reference(doc, optimizer, work)
    mine = _row(doc, optimizer, work, f"dml_optim {ref['auto_backend']}") if ref else None
    if mine is None:
        return ["n/a", "n/a"]
    fused = _row(doc, optimizer, work, "torch fused")
    ratio, _ = versus(doc, mine, "torch fused")
    return [f"{_ms(mine)} / {_ms(fused)}", "n/a" if ratio is None else f"{ratio:.2f}x"]


def speed_headline(cpu: dict, cuda: dict) -> str:
    """The short speed table: a few real models' Adam and AdamW steps beside torch's fused kernel, CPU and GPU."""
    gpu = cuda["machine"].get("gpu", "GPU").removeprefix("NVIDIA ").split(" ")[0]
    lines = [f"| workload | optimizer | CPU ms: dml_optim / torch fused | CPU speed-up | {gpu} ms: dml_optim / torch fused | "
             f"{gpu} speed-up |", "|---|---|---:|---:|---:|---:|"]
    for work, optimizer in _HEADLINE_SPEED:
        lines.append("| " + " | ".join([work, optimizer, *_speed_cells(cpu, work, optimizer),
                                        *_speed_cells(cuda, work, optimizer)]) + " |")
    m, g = cpu["machine"], cuda["machine"]
    note = (f"(One optimizer step, `backend=\"auto\"`, float32; the speed-up is torch fused's time over ours, the median "
            f"of round-by-round ratios. CPU: a {m['cpu_count']}-vCPU {m.get('cpu_model', m['processor'])} VM, torch "
            f"{m['torch']}, {cpu['created'][:10]} (`{SOURCES['cpu']}`); {gpu}: torch {g['torch']}, "
            f"{cuda['created'][:10]} (`{SOURCES['cuda']}`).)")
    return "\n".join(lines + ["", _fill(note)])


def _compare_rows(text: str) -> dict[str, dict[str, str]]:
    """The ``recorded`` stream's rows of a ``dml-optim compare`` report: config -> column -> cell."""
    header, rows = None, {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["config", "stream"]:
            header = cells
        elif header and len(cells) == len(header) and cells[1] == "recorded":
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def _precision_directml(name: str) -> str:
    """Whether the compare configuration ``name`` runs on DirectML, in words (bold: the recommended one)."""
    import torch

    from dml_optim.benchmark.wholemem import RECOMMENDED
    from dml_optim.precision import CONFIGS

    if CONFIGS[name].param_dtype == torch.bfloat16:
        return NOT_ON_DIRECTML
    return f"**{RECOMMENDED}**" if name == _DIRECTML_LEAN else "yes"


def precision_headline(text: str, source: str) -> str:
    """The short precision table: each configuration's drift from float64 and final loss, from a compare report."""
    rows = _compare_rows(text)
    first = text.splitlines()[0].removeprefix("# ")  # "dml-optim compare: adam on mlp"
    lines = ["| configuration | runs on DirectML | relative error after 200 steps (float64 = 0) | updates lost to rounding "
             "| final loss |", "|---|---|---:|---:|---:|"]
    for config in _HEADLINE_PRECISION:
        r = rows[config]
        lines.append(f"| `{config}` | {_precision_directml(config)} | {r['final ‖Δ‖/‖x‖']} | {r['lost updates']} | "
                     f"{r['final loss']} |")
    note = (f"({first}, 200 steps: the gradients of an FP32 training run of the built-in MLP fed to each configuration "
            f"and to a float64 reference. The bf16 configurations run on the CPU and CUDA only: DirectML has no "
            f"bfloat16. The whole report, with the synthetic stream, every configuration and the "
            f"command that reproduces it: `{source}`.)")
    return "\n".join(lines + ["", _fill(note)])


# -- the files --------------------------------------------------------------------------------------------


def _load(key: str) -> dict:
    return json.loads((ROOT / SOURCES[key]).read_text(encoding="utf-8"))


def lowbit_section(doc: dict) -> str:
    """The low-bit row (``dml-optim bench --rows lowbit``): ours at 8 and 4 bits beside torch fused and the peers,
    then its target."""
    targets = [t for t in doc["targets"] if "8-bit" in t["target"]]
    return "\n".join([
        _machine(doc, SOURCES["lowbit"]),
        "",
        *report.lowbit_table(doc),
        "",
        *report.targets_table({"targets": targets}),
    ])


def _memory_table() -> str:
    from dml_optim.precision import CONFIGS
    from dml_optim.precision.memory import OPTIMIZERS, measure, memory_table

    return memory_table([measure(name, config) for name in OPTIMIZERS for config in CONFIGS.values()])


def _training_bytes() -> str:
    from dml_optim.precision import CONFIGS
    from dml_optim.precision.memory import TRAINING_CONFIGS, measure, training_bytes_table

    return training_bytes_table([measure("adamw", CONFIGS[c]) for c in TRAINING_CONFIGS])


def _directml(row: dict) -> str:
    """Whether a wholemem or fits row's configuration runs on DirectML, in words: the row's own ``directml`` (rows
    recorded since 2026-12-07), else what :data:`dml_optim.benchmark.wholemem.CONFIGS` says of its key."""
    from dml_optim.benchmark.wholemem import config

    if row.get("directml"):
        return row["directml"]
    try:
        return config(row["config"]).directml
    except ValueError:
        return "n/a"


def _directml_cell(row: dict) -> str:
    text = _directml(row)
    return f"**{text}**" if text.endswith("(recommended)") else text


def peak_table(doc: dict[str, Any], source: str) -> str:
    """Whole-training peaks measured by ``python -m dml_optim.benchmark.wholemem``: bytes per parameter at the
    steady peak of real training steps, both ``zero_grad`` styles, each beside torch.optim.AdamW FP32's, and
    whether each configuration runs on DirectML."""
    rows: dict[str, dict[str, dict]] = {}
    for row in doc["rows"]:
        rows.setdefault(row["config"], {})[row["zero_grad"]] = row
    ref = rows["torch-fp32"]
    styles = ("set_to_none=True", "set_to_none=False")

    def cell(row: dict | None, style: str) -> str:
        if row is None or row["status"] != "measured":
            return "n/a"
        base = ref[style]["peak_bytes_per_param"]
        return f"{row['peak_bytes_per_param']:.2f} ({row['peak_bytes_per_param'] / base:.2f}x)"

    lines = ["| configuration | runs on DirectML | peak B/param, `zero_grad(set_to_none=True)` | peak B/param, "
             "`set_to_none=False` | params + grads + state (arithmetic) |", "|---|---|---:|---:|---:|"]
    skipped = []
    for config, by_style in rows.items():
        first = by_style[styles[0]]
        if all(r["status"] != "measured" for r in by_style.values()):
            skipped.append(f"{first['label']} ({first['status']})")
            continue
        arith = next((r.get("arithmetic_bytes_per_param") for r in by_style.values() if r["status"] == "measured"), None)
        lines.append(f"| {first['label']} | {_directml_cell(first)} | {cell(by_style.get(styles[0]), styles[0])} | "
                     f"{cell(by_style.get(styles[1]), styles[1])} | {'n/a' if arith is None else f'{arith:.2f}'} |")
    m, model = doc["machine"], doc["model"]
    note = (f"(Measured, not computed: {model['description']}, {model['params'] / 1e6:.1f}M parameters; each row a "
            f"subprocess running forward, backward, clipping, step and zero_grad (the step inside backward: no "
            f"clipping, which it refuses), its peak resident size (VmHWM, "
            f"freed blocks returned to the OS) above the resident size before the model existed, divided by the "
            f"parameters; the ratio is to torch.optim.AdamW FP32's peak in the same style. A {m.get('cpu_count')}-core "
            f"{m.get('cpu_model', 'CPU')} VM, {m.get('torch_threads')} threads, torch {doc['versions'].get('torch')}, {doc['created'][:10]} (`{source}`, written by "
            f"`python -m dml_optim.benchmark.wholemem`).")
    if doc["method"].get("eager_layout"):
        note += (" Rows of the eager backend (DirectML's path) lay their scratch out as DirectML does: a float32 step "
                 "in chunks within 32 MiB or 0.5 B/param (the CPU's own eager float32 step keeps a full-size scratch, "
                 "4 B/param more, for speed).")
    if doc["method"].get("loss_scaling"):
        note += (" The rows \"with DynamicLossScaler\" run `dml_optim.step_in_backward(opt, "
                 "scaler=dml_optim.DynamicLossScaler())` and `scaler.scale(loss).backward(); scaler.update()`: each run "
                 "of parameters unscaled in float32, checked and stepped inside backward, what float16 needs.")
    if any(_directml(r) == NOT_ON_DIRECTML for r in doc["rows"]):
        note += (" DirectML has no bfloat16 (torch-directml ends the process on a bfloat16 tensor, "
                 "microsoft/DirectML#688): the bf16 rows are measured on the CPU for comparison; on DirectML the lean "
                 "configuration is float16 with stochastic rounding, 8-bit or 4-bit state and the step inside backward "
                 "with a DynamicLossScaler.")
    carried = sorted({(r["carried_from"], r["label"]) for r in doc["rows"] if r.get("carried_from")})
    if carried:
        note += " " + _carried_note(carried, m)
    if skipped:
        note += " Not measured: " + "; ".join(skipped) + "."
    note += ")"
    return "\n".join(lines + ["", _fill(note)])


def _carried_note(carried: list[tuple[str, str]], machine: dict) -> str:
    """The sentence on rows carried from another run of the tool: which, from where, and on what machine when it is
    not this run's."""
    by_source: dict[str, list[str]] = {}
    for src, label in carried:
        by_source.setdefault(src, []).append(label)
    parts = []
    for src, labels in by_source.items():
        other = json.loads((ROOT / src).read_text(encoding="utf-8"))
        om = other["machine"]
        same = om.get("cpu_model") == machine.get("cpu_model")
        where = ("on this machine" if same else
                 f"on a {om.get('cpu_count')}-core {om.get('cpu_model', 'CPU')} VM, {other['created'][:10]}")
        parts.append(f"{', '.join(labels)} (`{src}`, {where})")
    return ("Rows from another run of the same tool (a package this run did not have, whose code paths did not "
            "change, or an optimizer added since, measured beside torch.optim.AdamW FP32 in that run): "
            + "; ".join(parts) + ".")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def fits_table(doc: dict, source: str) -> str:
    """The deepest GPT of one width that trains in a memory budget (``python -m dml_optim.benchmark.fits``), per
    configuration, measured; then, where the document has them, the depths its measured lines predict for larger
    budgets, extrapolated (said so), with their formula, the measured points and any check."""
    budget = doc["budget_bytes"] / 1e9
    lines = [f"| configuration | runs on DirectML | deepest GPT that fits {budget:g} GB | parameters | measured peak | "
             "next depth's peak |", "|---|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        ratio = f" ({r['ratio_to_torch']:.1f}x)" if r.get("ratio_to_torch") and r["config"] != "torch-fp32" else ""
        nxt = r.get("next_peak_bytes")
        lines.append(f"| {r['label']} | {_directml_cell(r)} | {r['depth']} blocks | {r['params'] / 1e6:.1f}M{ratio} | "
                     f"{_gb(r['peak_bytes'])} | {'n/a' if nxt is None else _gb(nxt)} |")
    f, m = doc["family"], doc["machine"]
    note = (f"(Measured, not computed: GPTs of width {f['width']}, {f['heads']} heads, a tied embedding of "
            f"{f['vocab']} tokens, batch {f['batch']} x {f['seq']} tokens, as deep as fits; each depth a subprocess "
            "running forward, backward, step and zero_grad(set_to_none=True) (torch.optim's row clipping too, as in "
            "the peak table; the step inside backward refuses global-norm clipping), its peak resident size above "
            "the size before the model existed (the whole-training peak above). Every depth shown was measured, and "
            "so was the next one, which does not fit. "
            f"A {m.get('cpu_count')}-core {m.get('cpu_model', 'CPU')} VM, torch {doc['versions'].get('torch')}, "
            f"{doc['created'][:10]} (`{source}`, written by `python -m dml_optim.benchmark.fits`).)")
    out = lines + ["", _fill(note)]
    extra = doc.get("extrapolated")
    if extra:
        out += ["", *_extrapolated_table(extra, source, doc["rows"])]
    return "\n".join(out)


def _short_label(key: str, label: str) -> str:
    """A configuration's name in the extrapolated table: torch's reference, or the float16 lean rows by their bits."""
    from dml_optim.benchmark.wholemem import LEAN_FP16, config

    if key == "torch-fp32":
        return "torch.optim.AdamW, FP32"
    if key in LEAN_FP16:
        return f"dml_optim.AdamW, DirectML's lean configuration, {config(key).kwargs['state_bits']}-bit state"
    return label


def _extrapolated_table(extra: dict, source: str, rows: list[dict]) -> list[str]:
    """The depths a fits document's measured lines predict for larger budgets: extrapolated, said so, with the line,
    its measured points and the checks made at a predicted depth."""
    budgets = [b["budget_gb"] for b in extra["rows"][0]["budgets"]]
    head = ["configuration (extrapolated, not measured)", *(f"{b:g} GB" for b in budgets),
            "the line peak = a + b x depth, through the measured depths"]
    table = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(budgets) + "---|"]
    checks, low = [], []
    measured = {r["config"]: {int(d): m["peak_bytes"] for d, m in r["measured"].items()} for r in rows}
    for e in extra["rows"]:
        name = _short_label(e["config"], e["label"])
        cells = []
        for b in e["budgets"]:
            cells.append(f"{b['depth']} blocks, {b['params'] / 1e9:.2f}B")
            v = b.get("verified")
            if v:
                checks.append(f"{name} at {b['depth']} blocks, {_gb(v['peak_bytes'])} (the line: "
                              f"{_gb(b['predicted_peak_bytes'])})")
                if v["peak_bytes"] < 0.95 * b["predicted_peak_bytes"]:  # the growth per block beyond the fit
                    last = max(e["points"])
                    per_block = (v["peak_bytes"] - measured[e["config"]][last]) / (b["depth"] - last)
                    low.append(f"{per_block / 1e6:.1f} MB per block from {last} to {b['depth']} blocks against the "
                               f"line's {e['bytes_per_block'] / 1e6:.1f} ({name})")
        pts = ", ".join(str(d) for d in e["points"])
        table.append(f"| {name} | " + " | ".join(cells) + f" | a = {e['intercept_bytes'] / 1e9:.3f} GB, b = "
                     f"{e['bytes_per_block'] / 1e6:.2f} MB per block (depths {pts}; largest residual "
                     f"{e['max_residual_bytes'] / 1e6:.1f} MB) |")
    base = next((e for e in extra["rows"] if e["config"] == "torch-fp32"), None)
    ratios = ""
    if base:
        parts = [f"{_short_label(e['config'], e['label'])} " + ", ".join(
                     f"{b['params'] / bb['params']:.1f}x" for b, bb in zip(e["budgets"], base["budgets"]) if bb["params"])
                 for e in extra["rows"] if e is not base]
        ratios = (f" Parameters against torch.optim.AdamW FP32's at {', '.join(f'{b:g}' for b in budgets)} GB: "
                  + "; ".join(parts) + ".")
    note = ("(Extrapolated, not measured: the deepest depth is floor((budget - a) / b) for a budget in bytes of "
            "tensors (1 GB = 10^9 bytes; a card of that size has less usable memory: the driver, the context and "
            "the allocator keep some), a and b the least-squares line through each configuration's peaks measured "
            f"above (`{source}`) from depth 6 on: depth 2 is left out, since below 64M parameters the eager step's "
            "scratch is a fixed 32 MiB and above it grows with the parameters. The parameters are counted for that "
            "depth; activations stay those of batch 1 x 32 tokens (a larger batch or sequence needs more)." + ratios)
    if checks:
        note += " Measured at a predicted depth, on this machine: " + "; ".join(checks) + "."
        if low:
            note += (" Where the measurement is under the line, more blocks fit than the line says: the peak grew by "
                     "less per block beyond the measured depths than the line's slope (" + "; ".join(low)
                     + "), so its depths err on the small side there.")
    return [*table, "", _fill(note + ")")]


#: Marker name -> the function that writes the text between that marker pair.
TABLES = {
    "AUDIT-TABLE": lambda: audit_table(_load("audit"), SOURCES["audit"]),
    "SPEED-TABLE": lambda: speed_headline(_load("cpu"), _load("cuda")),
    "BENCH-TABLE": lambda: bench_section(_load("cpu"), _load("cuda")),
    "LOWBIT-TABLE": lambda: lowbit_section(_load("lowbit")),
    "PRECISION-TABLE": lambda: precision_headline((ROOT / COMPARE_REPORT).read_text(encoding="utf-8"), COMPARE_REPORT),
    "MEMORY-TABLE": _memory_table,
    "PEAK-TABLE": lambda: peak_table(_load("memory"), SOURCES["memory"]),
    "FITS-TABLE": lambda: fits_table(_load("fits"), SOURCES["fits"]),
    "TRAINING-BYTES": _training_bytes,
}
#: The tables measured when written (seconds each), not read from a committed document.
MEASURED = frozenset({"MEMORY-TABLE", "TRAINING-BYTES"})


def files() -> list[Path]:
    """Where generated tables may live: README.md and every page of the site."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _names_in(text: str) -> list[str]:
    return [name for name in TABLES if f"<!-- {name} -->" in text]


def sections(skip_measured: bool = False) -> dict[str, str]:
    """Marker name -> the text this script puts between that marker pair.  ``skip_measured``: a table of
    :data:`MEASURED` is the text its first file holds now (so the others are checked against that copy)."""
    texts = {path: path.read_text(encoding="utf-8") for path in files()}
    placed = {name for text in texts.values() for name in _names_in(text)}
    if placed != set(TABLES):
        raise ValueError(f"tables no file holds: {sorted(set(TABLES) - placed)}")
    out = {}
    for name, make in TABLES.items():
        if skip_measured and name in MEASURED:
            text = next(t for t in texts.values() if f"<!-- {name} -->" in t)
            out[name] = re.search(rf"<!-- {name} -->\n(.*?)\n<!-- /{name} -->", text, flags=re.S).group(1)
        else:
            out[name] = make()
    return out


def render(text: str, contents: dict[str, str]) -> str:
    """``text`` with the content between each marker pair replaced; ``ValueError`` naming a missing marker."""
    for name, body in contents.items():
        start, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
        i, j = text.find(start), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"the markers '<!-- {name} -->' and '<!-- /{name} -->' are missing or out of order")
        text = text[: i + len(start)] + body + "\n" + text[j:]
    return text


def render_file(text: str, contents: dict[str, str]) -> str:
    """``text`` with every table whose marker pair it holds rewritten."""
    return render(text, {name: contents[name] for name in _names_in(text)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="exit 1 with a diff where a file differs from the output")
    action.add_argument("--record-audit", action="store_true",
                        help="run `dml-optim audit --json` for every row; write bench/results/audit-<UTC date>.json")
    parser.add_argument("--skip-measured", action="store_true",
                        help="do not measure the memory tables: check that each file's copy equals the first one's")
    args = parser.parse_args(argv)
    if args.record_audit:
        record_audit(ROOT / "bench" / "results" / f"audit-{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}.json")
        return 0
    contents = sections(skip_measured=args.skip_measured)
    status = 0
    for path in files():
        current = path.read_text(encoding="utf-8")
        wanted = render_file(current, contents)
        if current == wanted:
            continue
        name = str(path.relative_to(ROOT))
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                       name, f"{name} (tools/readme_tables.py)"))
            status = 1
        else:
            path.write_text(wanted, encoding="utf-8")
            print(f"{name}: tables rewritten")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
