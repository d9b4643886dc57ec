"""``dml-optim bench``: optimizer steps side by side with torch.optim, and the issues' other measurements.

A thin layer over :mod:`dml_optim.benchmark` (``bench/run.py`` is the same
command for a source checkout): checks every argument before measuring (an
unusable device, an unknown row, optimizer or workload, a bad ``--budget``
or an unwritable ``--out`` is a one-line usage error, status 2), prints a
header, a line per measurement as it goes, then the tables and a summary,
and writes the JSON document to ``--out`` after every measurement (default
``dml-optim-out/bench/<device>-<UTC date>.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dml_optim.console import DEFAULT_OUTPUT_DIR

HELP = "measure optimizer steps (dml_optim eager/compiled vs torch.optim for-loop/foreach/fused) and more"
DESCRIPTION = (
    HELP + ". Candidates are measured in one process, round-robin, after warm-up; medians are reported with "
    "GB/s as a fraction of a bandwidth reference measured in the same rounds, round by round (the CPU's stream limit: "
    "the fastest of in-place passes add_, torch._fused_sgd_ and torch._fused_adam_ at lr=0; a 1 GiB copy on CUDA), "
    "kernel time (CUDA), ops per step, optimizer memory and compile time. Rows: speed (optimizer x "
    "workload), frozen (a LoRA model, gradual unfreezing), host (host work per parameter, checks=full/fast), "
    "instances (12 compiled Adam, the 12th vs the 2nd), memory (peak at construction, pack_via), construction "
    "(construction + first step vs torch fused, cold and warm), nonepattern (70% of 40 tensors with a gradient, "
    "the pattern changing every step, vs steady steps and torch fused), loops (AdamW in the loops people run: "
    "plain, LambdaLR, set_to_none with LambdaLR, on three models, vs torch fused; DirectML's eager path, host time "
    "per step), lowbit (8-bit and 4-bit AdamW), graph "
    "(many small tensors, capturable, in a CUDA graph). What the device cannot measure (off CUDA: the graph row, "
    "kernel time, the copy reference) is listed as not measured, with the reason. Writes JSON as it goes and "
    "prints markdown tables, a summary and the targets (PASS/MISS), each row's also beside it in the JSON."
)
EXAMPLES = f"""examples:
  dml-optim bench --quick                      # every row, small sizes: a smoke test
  dml-optim bench                              # full CPU run (tens of minutes on 2 cores)
  dml-optim bench --device cuda --budget 420   # full GPU run, no new measurement after 7 minutes
  dml-optim bench --rows speed --optimizers adam adamw --workloads resnet50 many-small
  dml-optim bench --rows host memory --out host.json
  dml-optim bench --rows nonepattern construction --optimizers adamw
  python bench/run.py --quick                  # the same, from a source checkout

workloads (speed rows): a built-in model name (resnet50, gpt2, bert-base-uncased,
vit-b-16, tiny-mlp, many-small), many-small-N (N x 1,024), one-Nk or one-Nm (one
tensor of N * 2**10 or N * 2**20 elements), or the path of an inventory JSON file.

writes ./{DEFAULT_OUTPUT_DIR}/bench/<device>-<UTC date>.json (-quick.json with --quick) unless --out says otherwise
"""


def add_parser(sub):
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dml_optim.benchmark import OPTIMIZERS, QUICK_WORKLOADS, ROWS, default_rows, default_workloads

    p.add_argument("--quick", action="store_true",
                   help=f"small sizes (speed: {', '.join(QUICK_WORKLOADS)}), few rounds: a smoke test of every row")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "privateuseone"), help="device to measure on (default: cpu)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON output file (default: {DEFAULT_OUTPUT_DIR}/bench/<device>-<UTC date>.json; "
                        "-quick.json with --quick), rewritten after every measurement")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=None, metavar="ROW",
                   help=f"rows to measure, of {', '.join(ROWS)} (default: cpu {' '.join(default_rows('cpu'))}; "
                        f"cuda {' '.join(default_rows('cuda'))})")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=None, metavar="NAME",
                   help=f"optimizers of the speed, frozen, host, nonepattern and construction rows (default: all of "
                        f"{', '.join(OPTIMIZERS)})")
    p.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help=f"workloads of the speed rows (default: cpu {', '.join(default_workloads('cpu'))}; cuda "
                        f"{', '.join(default_workloads('cuda'))}; with --quick: {', '.join(QUICK_WORKLOADS)}); a built-in "
                        "model name or an inventory JSON path, or many-small-N (N x 1,024), one-Nk and one-Nm "
                        "(one tensor of N * 2**10 or N * 2**20 elements)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no new measurement after this many seconds; the rest are listed as skipped")


def run(args) -> int:
    from dml_optim import benchmark
    from dml_optim.commands import UsageError
    from dml_optim.console import Progress

    try:
        plan = benchmark.make_plan(device=args.device, quick=args.quick, rows=args.rows, optimizers=args.optimizers,
                                   workloads=args.workloads, budget_s=args.budget)
    except ValueError as exc:  # "argument: message"
        argument, _, message = str(exc).partition(": ")
        raise UsageError(f"--{argument}: {message}") from None
    out = args.out or benchmark.default_output_path(args.device, quick=args.quick)
    if out.is_dir():
        raise UsageError(f"--out: '{out}' is a directory; give a file name")
    try:  # before the measurements, not after them
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot write '{out}' ({exc.strerror or exc})") from None
    print(f"dml-optim bench{' --quick' if args.quick else ''}: device {plan.device}, rows {', '.join(plan.rows)}, "
          f"optimizers {', '.join(plan.optimizers)}, workloads {', '.join(w.name for w in plan.workloads)}"
          f"{f', budget {args.budget:g} s' if args.budget else ''}; {len(plan.tasks)} measurements; results to {out}",
          flush=True)
    with Progress("bench", len(plan.tasks), stream=sys.stdout, unit="measurement") as progress:
        doc = benchmark.run_plan(plan, log=progress.write, progress=lambda done, total, what: progress.update(done, what),
                                 checkpoint=lambda d: benchmark.write_json(d, out))
    print(benchmark.format_report(doc))
    print()
    print(benchmark.format_summary(doc))
    print(f"\nwrote {out}")
    return 0
