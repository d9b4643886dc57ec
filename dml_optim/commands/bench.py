"""``dml-optim bench``: optimizer-step speed side by side with torch.optim.

A thin layer over :mod:`dml_optim.benchmark` (``bench/run.py`` is the same
command for a source checkout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "measure optimizer steps (dml_optim eager/compiled vs torch.optim for-loop/foreach/fused)"
DESCRIPTION = (
    HELP + ". Candidates are measured in one process, round-robin, after warm-up; medians are "
    "reported with GB/s, the fraction of a triad's bandwidth measured in the same run, ops per step, "
    "optimizer memory and compile time. Writes JSON and prints a markdown table and the targets (PASS/MISS)."
)
EXAMPLES = """examples:
  dml-optim bench --quick                      # small smoke run (seconds once compiled)
  dml-optim bench                              # full run: resnet50, bert-base-uncased, gpt2, many-small, one-64m
  dml-optim bench --device cuda --out cuda.json
  dml-optim bench --optimizers adam --workloads resnet50 many-small
  python bench/run.py --quick                  # the same, from a source checkout
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
                   help="JSON output file (default: bench/results/<device>-<UTC date>.json; -quick.json with --quick)")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=None, metavar="NAME",
                   help=f"optimizers to measure (default: all of {', '.join(OPTIMIZERS)})")
    p.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help=f"workloads (default: {', '.join(FULL_WORKLOADS)}; with --quick: {', '.join(QUICK_WORKLOADS)}); "
                   "also many-small-N (N x 1,024), one-Nk and one-Nm (one tensor of N * 2**10 or N * 2**20 elements)")


def run(args) -> int:
    import sys

    from dml_optim import benchmark
    from dml_optim.cli import UsageError

    for name in args.workloads or ():
        try:
            benchmark.workload(name)
        except ValueError as exc:
            raise UsageError(f"--workloads: {exc}") from None
    if args.out is not None and args.out.is_dir():
        raise UsageError(f"--out: '{args.out}' is a directory; give a file name")
    if args.out is not None:
        try:  # before the measurements, not after them
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out: cannot write '{args.out}' ({exc.strerror or exc})") from None
    doc = benchmark.run_benchmark(device=args.device, quick=args.quick, optimizers=args.optimizers,
                                  workloads=args.workloads, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = args.out or benchmark.default_output_path(args.device, quick=args.quick)
    benchmark.write_json(doc, out)
    print(benchmark.format_table(doc))
    print(f"\nwrote {out}")
    return 0
