"""``dml-optim bench``: optimizer-step speed side by side with torch.optim.

A thin layer over :mod:`dml_optim.benchmark` (``bench/run.py`` is the same
command for a source checkout): checks every argument before measuring (an
unusable device, an unknown workload or an unwritable ``--out`` is a one-line
usage error, status 2), prints a header, progress per (optimizer, workload)
group, then the table, and writes the JSON document to ``--out`` (default
``dml-optim-out/bench/<device>-<UTC date>.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dml_optim.console import DEFAULT_OUTPUT_DIR

HELP = "measure optimizer steps (dml_optim eager/compiled vs torch.optim for-loop/foreach/fused)"
DESCRIPTION = (
    HELP + ". Candidates are measured in one process, round-robin, after warm-up; medians are "
    "reported with GB/s, the fraction of a triad's bandwidth measured in the same run, ops per step, "
    "optimizer memory and compile time. Writes JSON and prints a markdown table and the targets (PASS/MISS)."
)
EXAMPLES = f"""examples:
  dml-optim bench --quick                      # small smoke run (seconds once compiled)
  dml-optim bench                              # full run: resnet50, bert-base-uncased, gpt2, many-small, one-64m
  dml-optim bench --device cuda --out cuda.json
  dml-optim bench --optimizers adam --workloads resnet50 many-small
  python bench/run.py --quick                  # the same, from a source checkout

workloads: a built-in model name (resnet50, gpt2, bert-base-uncased, vit-b-16,
tiny-mlp, many-small), many-small-N (N x 1,024), one-Nk or one-Nm (one tensor
of N * 2**10 or N * 2**20 elements), or the path of an inventory JSON file.

writes ./{DEFAULT_OUTPUT_DIR}/bench/<device>-<UTC date>.json (-quick.json with --quick) unless --out says otherwise
"""


def add_parser(sub):
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dml_optim.benchmark import FULL_WORKLOADS, OPTIMIZERS, QUICK_WORKLOADS

    p.add_argument("--quick", action="store_true",
                   help=f"small workloads ({', '.join(QUICK_WORKLOADS)}), few rounds: a smoke test")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "privateuseone"), help="device to measure on (default: cpu)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON output file (default: {DEFAULT_OUTPUT_DIR}/bench/<device>-<UTC date>.json; "
                        "-quick.json with --quick)")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=None, metavar="NAME",
                   help=f"optimizers to measure (default: all of {', '.join(OPTIMIZERS)})")
    p.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help=f"workloads (default: {', '.join(FULL_WORKLOADS)}; with --quick: {', '.join(QUICK_WORKLOADS)}); "
                   "a built-in model name or an inventory JSON path, or many-small-N (N x 1,024), one-Nk and one-Nm "
                   "(one tensor of N * 2**10 or N * 2**20 elements)")


def run(args) -> int:
    from dml_optim import benchmark
    from dml_optim.cli import UsageError
    from dml_optim.console import Progress
    from dml_optim.training import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    workloads = list(args.workloads or (benchmark.QUICK_WORKLOADS if args.quick else benchmark.FULL_WORKLOADS))
    for name in workloads:
        try:
            benchmark.workload(name)
        except ValueError as exc:
            raise UsageError(f"--workloads: {exc}") from None
    out = args.out or benchmark.default_output_path(args.device, quick=args.quick)
    if out.is_dir():
        raise UsageError(f"--out: '{out}' is a directory; give a file name")
    try:  # before the measurements, not after them
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot write '{out}' ({exc.strerror or exc})") from None
    optimizers = list(args.optimizers or benchmark.OPTIMIZERS)
    print(f"dml-optim bench{' --quick' if args.quick else ''}: device {device}, optimizers {', '.join(optimizers)}, "
          f"workloads {', '.join(workloads)}; results to {out}", flush=True)
    with Progress("bench", len(optimizers) * len(workloads), stream=sys.stdout, unit="group") as progress:
        doc = benchmark.run_benchmark(device=args.device, quick=args.quick, optimizers=optimizers,
                                      workloads=workloads, log=progress.write,
                                      progress=lambda done, total, what: progress.update(done, what))
    benchmark.write_json(doc, out)
    print(benchmark.format_table(doc))
    print(f"\nwrote {out}")
    return 0
