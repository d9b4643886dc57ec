"""``dml-optim compare``: FP16/BF16 configurations against a float64 reference.

A thin layer over :func:`dml_optim.precision.compare`: prints a header (what
runs, for how many steps, how much memory it needs, where the report goes),
progress while the streams run, then the table and the findings, and writes
``DIR/report.md``, ``DIR/report.json`` and ``DIR/divergence.png`` (``DIR``:
``--out``, default ``dml-optim-out/compare``).  The plot needs matplotlib
(``pip install 'dml-optim[plot]'``); without it the command still writes the
Markdown and JSON reports, says that the PNG was not written and why, and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from dml_optim.console import DEFAULT_OUTPUT_DIR

HELP = "compare FP16/BF16 optimizer configurations against a float64 reference"
DESCRIPTION = """Feed one identical gradient stream through every precision configuration
({configs}) and a float64 reference, and report how far each drifts: relative error,
ULP distance, NaN/Inf, lost updates, flushed second moments, gradient underflow, final
loss, and plain-language findings (among them what FP32 master weights and Kahan
compensation keep, and at what memory, and whether stochastic rounding beats plain
FP16/BF16 and where Kahan is still closer). The bf16 configurations run on the CPU and
CUDA only (DirectML has no bfloat16); fp16-sr-8bit is DirectML's lean configuration."""
EXAMPLES = f"""examples:
  dml-optim compare                                        # adam on the built-in MLP, 200 steps
  dml-optim compare --optimizer dml-adam --out my-report   # DirectML's rule (epsilon 1e-8)
  dml-optim compare --optimizer dml-adam --epsilon 1e-4
  dml-optim compare --optimizer adamw --configs fp32,fp16-master,fp16-kahan
  dml-optim compare --configs bf16,bf16-kahan,bf16-sr             # stochastic rounding against plain BF16 and Kahan
  dml-optim compare --configs fp32,fp16-sr-8bit,fp16-kahan-8bit    # DirectML's lean configuration (FP16: it has no BF16)
  dml-optim compare --workload resnet50 --steps 5          # a built-in model's shapes (~7 GB of memory)
  dml-optim compare --workload gpt2 --steps 3              # slow: 124M parameters, ~32 GB of memory
  dml-optim compare --workload my-model.json               # an inventory file

workloads: mlp (the built-in model), a built-in model name (resnet50, gpt2,
bert-base-uncased, vit-b-16, tiny-mlp, many-small; many-small-N, one-Nk, one-Nm)
or the path of an inventory JSON file.

writes DIR/report.md, DIR/report.json and DIR/divergence.png (DIR defaults to ./{DEFAULT_OUTPUT_DIR}/compare)
"""

#: Peak memory per parameter of a run with every configuration, measured: resnet50
#: (25.6M parameters) peaks at 6.3 GB (maximum resident set) with the default
#: configurations (seven) and streams.
PEAK_BYTES_PER_PARAMETER = 260


def add_parser(sub):
    from dml_optim.optimizers.registry import NAMES
    from dml_optim.precision import CONFIGS, STREAMS

    p = sub.add_parser("compare", help=HELP, description=DESCRIPTION.format(configs=", ".join(CONFIGS)),
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=NAMES, default="adam", help="update rule (default: adam)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per stream (default: 200 for mlp; 200/20/3 for models up to 1M/10M/more parameters; "
                        f"a run needs about {PEAK_BYTES_PER_PARAMETER} bytes of memory per parameter)")
    p.add_argument("--workload", default="mlp", metavar="WORKLOAD",
                   help="'mlp' (the built-in model), a built-in model name or an inventory JSON path (default: mlp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and streams (default: 0)")
    p.add_argument("--out", default=str(DEFAULT_OUTPUT_DIR / "compare"), metavar="DIR",
                   help=f"output folder (default: ./{DEFAULT_OUTPUT_DIR}/compare)")
    p.add_argument("--streams", default=None, metavar="LIST",
                   help=f"comma-separated streams from {', '.join(STREAMS)} (default: recorded,synthetic for mlp; "
                        "gaussian,synthetic for an inventory)")
    p.add_argument("--configs", default=None, metavar="LIST",
                   help=f"comma-separated configurations from {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the optimizer's)")
    p.add_argument("--epsilon", type=float, default=None,
                   help="the optimizer's epsilon (AdamW's eps; Momentum has none; default: the optimizer's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.set_defaults(run=run)
    return p


def _list(flag: str, value: str | None, allowed) -> list[str] | None:
    from dml_optim.commands import UsageError

    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    for item in items:
        if item not in allowed:
            raise UsageError(f"{flag}: bad value {item!r} (choose from {', '.join(allowed)})")
    if not items:
        raise UsageError(f"{flag}: empty list")
    return items


def _megabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{max(1, round(n / 1e6))} MB"


def _workload(workload: str) -> tuple[str, int, int]:
    """``(name, tensors, parameters)`` of ``--workload``; a usage error when it names nothing."""
    from dml_optim.commands import UsageError

    if workload == "mlp":
        from dml_optim.job import toy

        shapes = [p.shape for p in toy.make_model(0).parameters()]
        return "mlp", len(shapes), sum(math.prod(s) for s in shapes)
    from dml_optim.inventory import resolve_model

    try:
        inv = resolve_model(workload)
    except ValueError as exc:
        raise UsageError(f"--workload: not 'mlp', and {exc}") from None
    return inv.name, inv.num_tensors, inv.numel


def _check(args) -> tuple[list[str] | None, list[str] | None, dict]:
    from dml_optim.commands import UsageError
    from dml_optim.precision import CONFIGS, STREAMS, epsilon_name

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps: bad value {args.steps} (must be >= 1)")
    streams = _list("--streams", args.streams, STREAMS)
    if streams and "recorded" in streams and args.workload != "mlp":
        raise UsageError("--streams: 'recorded' needs the built-in model (--workload mlp); an inventory has shapes only")
    configs = _list("--configs", args.configs, list(CONFIGS))
    hyper = {}
    if args.lr is not None:
        if not args.lr >= 0 or args.lr == float("inf"):
            raise UsageError(f"--lr: bad value {args.lr} (must be a finite number >= 0)")
        hyper["lr"] = args.lr
    if args.epsilon is not None:
        eps = epsilon_name(args.optimizer)
        if eps is None:
            raise UsageError(f"--epsilon: {args.optimizer} has no epsilon")
        if not args.epsilon >= 0 or args.epsilon == float("inf"):
            raise UsageError(f"--epsilon: bad value {args.epsilon} (must be a finite number >= 0)")
        hyper[eps] = args.epsilon
    return streams, configs, hyper


def _command_line(args, steps: int, streams: list[str], configs: list[str]) -> str:
    """The command that reproduces a run's numbers: every setting explicit (``--out`` and
    ``--no-progress`` change no number and are left out)."""
    words = ["dml-optim", "compare", "--optimizer", args.optimizer, "--workload", args.workload, "--steps", str(steps),
             "--seed", str(args.seed), "--streams", ",".join(streams), "--configs", ",".join(configs)]
    for flag, value in (("--lr", args.lr), ("--epsilon", args.epsilon)):
        if value is not None:
            words += [flag, f"{value:g}"]
    return shlex.join(words)


def run(args) -> int:
    from dml_optim.commands import UsageError
    from dml_optim.console import Progress
    from dml_optim.precision import CONFIGS, compare, default_steps

    streams, configs, hyper = _check(args)
    name, tensors, numel = _workload(args.workload)
    out = Path(args.out)
    try:  # before a long run, not after it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot use '{args.out}' as the report folder ({exc.strerror or exc})") from None
    steps = args.steps or default_steps(numel)
    stream_names = streams or (["recorded", "synthetic"] if args.workload == "mlp" else ["gaussian", "synthetic"])
    config_names = configs or list(CONFIGS)
    print(f"dml-optim compare: {args.optimizer} on {name} ({tensors} tensors, {numel:,} parameters), "
          f"{steps} steps per stream ({', '.join(stream_names)}), configurations {', '.join(config_names)}; "
          f"about {_megabytes(PEAK_BYTES_PER_PARAMETER * numel)} of memory; report to {out}", flush=True)
    progress = None if args.no_progress else Progress("compare", steps * len(stream_names), stream=sys.stdout)
    try:
        report = compare(args.optimizer, steps=steps, workload=args.workload, seed=args.seed, streams=streams,
                         configs=configs, hyperparameters=hyper or None,
                         progress=None if progress is None else lambda done, total: progress.update(done))
    finally:
        if progress is not None:
            progress.close()
    report.command = _command_line(args, steps, stream_names, config_names)
    png = out / "divergence.png"
    plot_note = None
    try:
        lines = report.save_plot(png)
        report.plot = {"path": png.name, "lines": lines}
    except ImportError as exc:
        plot_note = f"{png} not written: {exc}"
        report.notes.append(plot_note)
    (out / "report.md").write_text(report.to_markdown(), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    print(f"{report.optimizer} on {report.workload}: {report.steps} steps per stream, seed {report.seed}; "
          "error against a float64 reference")
    print(report.table())
    print()
    print("findings:")
    for finding in report.findings:
        print(f"  - {finding}")
    print()
    written = [out / "report.md", out / "report.json"] + ([png] if report.plot else [])
    print("wrote " + ", ".join(str(p) for p in written))
    if plot_note:
        print(f"note: {plot_note}")
    return 0
