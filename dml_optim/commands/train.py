"""``dml-optim train``: train the built-in model on the built-in data, optionally next to torch.optim."""

from __future__ import annotations

import argparse
import json
import math
import sys

from dml_optim.job import toy
from dml_optim.optimizers.spec import IMPLEMENTATION_FLAGS
from dml_optim.core.options import OPTION_NAMES
from dml_optim.optimizers.registry import NAMES, spec
from dml_optim.optimizers.registry import epsilon_name
from dml_optim.job.train import (
    DEFAULT_BATCH_SIZE, DEFAULT_STEPS, DEVICES, DTYPES, FP16_EPSILON, ROUNDINGS, RunResult, TrainConfig,
)

HELP = "train a small MLP on built-in data with a dml_optim optimizer (and, optionally, torch.optim)"
DESCRIPTION = f"""\
Train a small MLP ({toy.NUM_FEATURES}-{toy.HIDDEN}-{toy.HIDDEN}-{toy.NUM_CLASSES}) on a built-in, deterministic
{toy.NUM_CLASSES}-class spiral dataset ({toy.N_TRAIN} training / {toy.N_TEST} held-out points, generated
in-process: nothing is downloaded) on the best available device (DirectML,
else CUDA, else CPU), then print a summary: device, optimizer and
hyperparameters, training loss before and after, held-out accuracy, median
step times, and per optimizer step the aten op count and the ops that would
fall back to the CPU on DirectML (recorded on one extra step, resolved with
the torch-directml 0.2.5 dispatch table)."""
EXAMPLES = f"""\
examples:
  dml-optim train                              # Adam, {DEFAULT_STEPS} steps, float32
  dml-optim train --optimizer dml-adam --compare-torch
  dml-optim train --optimizer adamw --compare-torch  # against torch.optim.AdamW
  dml-optim train --dtype float16 --steps 300
  dml-optim train --dtype mixed                # FP16 params, FP32 master weights, loss scaling
  dml-optim train --optimizer adamw --dtype float16 --rounding stochastic --state-bits 8 --step-in-backward
                                               # DirectML's lean configuration (no bfloat16 on DirectML)
  dml-optim train --optimizer momentum --lr 0.1 --json

default learning rates: {', '.join(f'{name} {spec(name).train_lr:g}' for name in NAMES)}
--dtype float16 sets the epsilon to {FP16_EPSILON:g}: {', '.join(f'{name} {epsilon_name(name)}' for name in NAMES if epsilon_name(name))}.
"""

#: Group keys that describe the implementation, not the update rule (left out of the summary):
#: our options (``master_weights`` and ``kahan`` are named when on) and torch.optim's flags.
_NOT_MATH = (set(OPTION_NAMES) - {"master_weights", "kahan"}) | (set(IMPLEMENTATION_FLAGS) - {"foreach"}) | {
    "maximize", "amsgrad", "initial_accumulator_value", "nesterov", "param_names"}
_NAMED_WHEN_ON = ("master_weights", "kahan")


def _arg_type(convert, ok, expected: str):
    """An argparse ``type``: ``convert(text)``, accepted when ``ok(value)``;
    otherwise the one-line error ``expected <expected>, got '<text>'``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _arg_type(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _arg_type(int, lambda v: v >= 0, "a non-negative integer")
_positive_float = _arg_type(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_seed = _arg_type(int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")


def add_parser(sub):
    p = sub.add_parser("train", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=NAMES, default="adam", help="dml_optim optimizer (default: adam)")
    p.add_argument("--lr", type=_positive_float, default=None, help="learning rate (default: per optimizer, see below)")
    p.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, help=f"training steps (default: {DEFAULT_STEPS})")
    p.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"examples per step (default: {DEFAULT_BATCH_SIZE})")
    p.add_argument("--state-bits", type=int, choices=(8, 4), default=None,
                   help="dml_optim's optimizer state in 8 or 4 bits per value, block-quantized (default: full precision)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="float32; float16 (FP16 params and state; DirectML's half precision); bfloat16 (BF16 "
                        "params: CPU and CUDA only, it does not run on DirectML, which has no bfloat16); mixed (FP16 "
                        "params, FP32 master weights and state, dynamic loss scaling). DirectML's lean configuration: "
                        "--dtype float16 --rounding stochastic --state-bits 8 --step-in-backward (default: float32)")
    p.add_argument("--rounding", choices=ROUNDINGS, default="nearest",
                   help="ours: how float16/bfloat16 parameters are rounded after the update; stochastic with "
                        "--dtype float16 is DirectML's lean configuration (bfloat16 does not run on DirectML) "
                        "(default: nearest)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="ours: step each run of parameters inside backward, its gradients then dropped; with --dtype "
                        "float16 the loss is scaled inside backward (a DynamicLossScaler: each run unscaled and "
                        "checked as its gradients arrive), DirectML's lean configuration with --rounding stochastic "
                        "--state-bits 8")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto = DirectML, else CUDA, else CPU (default: auto)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the data, the initial weights and the batches (default: 0)")
    p.add_argument("--threads", type=_non_negative_int, default=1,
                   help="CPU threads for torch (default: 1, the model is too small to gain from more; 0: torch's default)")
    p.add_argument("--compare-torch", action="store_true",
                   help="also train with the equivalent torch.optim optimizer (same weights, same batches)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(run=run)
    return p


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------

def _hyper_text(result: RunResult) -> str:
    items = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
             for k, v in result.hyperparameters.items()
             if k not in _NOT_MATH and not (k in _NAMED_WHEN_ON and not v) and not (k == "foreach" and v is None)]
    return f"{result.optimizer}({', '.join(items)})"


def _audit_cells(result: RunResult) -> tuple[str, str, str]:
    audit = result.audit
    if "error" in audit:
        return ("n/a", f"audit failed: {audit['error']}", "n/a")
    fallbacks = ", ".join(f"{f['op']} x{f['count']}" for f in audit.get("fallbacks", []))
    return (str(audit["total_ops"]),
            f"{audit['fallback_ops']}" + (f" ({fallbacks})" if fallbacks else ""),
            str(audit["host_syncs"]))


def _rows(result: RunResult) -> list[tuple[str, str]]:
    ops, fallbacks, syncs = _audit_cells(result)
    rows = [
        ("precision", f"params {result.param_dtype}, state {result.state_dtype}"),
        ("train loss, start -> end", f"{result.initial_loss:.4f} -> {result.final_loss:.4f}"),
        ("held-out accuracy", f"{100 * result.test_accuracy:.1f}% (chance {100 * result.chance:.0f}%)"),
        ("train accuracy", f"{100 * result.train_accuracy:.1f}%"),
        ("median training step", f"{result.median_step_ms:.3f} ms"),
        ("median optimizer step", f"{result.median_optimizer_step_ms:.3f} ms"),
        ("aten ops per optimizer step", ops),
        ("DirectML CPU fallbacks per step", fallbacks),
        ("host syncs per step", syncs),
    ]
    if result.directml_fallbacks is not None:  # (the stand-in: what really ran on the CPU, forward and backward too)
        counted = result.directml_fallbacks
        rows.append(("CPU fallbacks, whole run (stand-in)",
                     ", ".join(f"{op} x{n}" for op, n in sorted(counted.items())) if counted else "0"))
    if result.skipped_steps is not None:
        rows.append(("steps skipped (inf/NaN grads)", str(result.skipped_steps)))
    if result.loss_scale is not None:
        rows.append(("final loss scale", f"{result.loss_scale:g}"))
    return rows


def format_header(header: dict) -> str:
    """What runs, where: printed before training starts (before any progress)."""
    config = header["config"]
    device = f"device: {header['device']}"
    if header["requested_device"] == "auto" and not header["directml"]["available"]:
        device += f" (not DirectML: {header['directml']['reason']})"
    elif header["directml"]["available"] and header["device"].startswith("privateuseone"):
        device += f" ({header['directml']['reason']})"
    return "\n".join([
        f"dml-optim train: {config['steps']} steps of {config['batch_size']} on the built-in "
        f"{header['num_classes']}-class spiral data ({header['n_train']} train / {header['n_test']} held-out), "
        f"--dtype {config['dtype']}, seed {config['seed']}"
        + (f", --state-bits {config['state_bits']}" if config.get("state_bits") else ""),
        device,
        f"torch {header['torch']}, CPU threads {header['threads']}",
    ])


def format_summary(results: list[RunResult]) -> str:
    """The text summary printed after training: the optimizers, then one column per run."""
    first = results[0]
    lines = []
    for result in results:
        lines.append(f"optimizer: {_hyper_text(result)}")
    lines.append("")
    per_run = [dict(_rows(r)) for r in results]
    labels = list(dict.fromkeys(label for r in results for label, _ in _rows(r)))  # union, in order
    table = [labels] + [[rows.get(label, "n/a") for label in labels] for rows in per_run]
    width = [max(len(c) for c in col) for col in table]
    names = [""] + [r.optimizer for r in results]
    lines.append("  ".join(n.ljust(w) for n, w in zip(names, width)).rstrip())
    for i in range(len(table[0])):
        lines.append("  ".join(col[i].ljust(w) for col, w in zip(table, width)).rstrip())
    lines.append("")
    lines.append("Ops and fallbacks: one optimizer.step() recorded after training, each aten op resolved with "
                 "torch-directml 0.2.5's dispatch table (what the step would dispatch on DirectML).")
    if first.dtype == "mixed":
        lines.append("Mixed precision: the audit records optimizer.step() alone, without the loss scaler's "
                     "unscale and inf/NaN check.")
    if len(results) > 1 and first.optimizer.endswith(("Adam", "DmlAdam")):
        lines.append("Note: dml_optim adds epsilon to the uncorrected sqrt(H) (ONNX/DirectML); torch.optim.Adam "
                     "adds it after bias correction, so the runs agree closely, not bit for bit.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------

def run(args) -> int:
    import torch

    from dml_optim.commands import UsageError
    from dml_optim.console import Progress
    from dml_optim.devices import directml
    from dml_optim.job.train import resolve_device, train

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    if device.type == "privateuseone" and args.dtype == "bfloat16":
        raise UsageError(f"--dtype bfloat16: DirectML ({device}) has no bfloat16 (torch-directml ends the process on a "
                         "bfloat16 tensor); use --dtype float16 --rounding stochastic (DirectML's half precision) or "
                         "--dtype float32")
    if args.compare_torch:
        from dml_optim.optimizers.registry import spec

        if not spec(args.optimizer).torch.exists:
            raise UsageError(f"--compare-torch: torch.optim has no twin of {args.optimizer!r} to train beside it")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(optimizer=args.optimizer, lr=args.lr, steps=args.steps, batch_size=args.batch_size,
                         dtype=args.dtype, seed=args.seed, state_bits=args.state_bits,
                         rounding=args.rounding, step_in_backward=args.step_in_backward).validated()
    dml_ok, dml_reason, _ = directml()
    header = {
        "config": {"optimizer": config.optimizer, "lr": config.lr, "steps": config.steps,
                   "batch_size": config.batch_size, "dtype": config.dtype, "seed": config.seed,
                   "hidden": config.hidden, "state_bits": config.state_bits, "rounding": config.rounding,
                   "step_in_backward": config.step_in_backward},
        "n_train": config.n_train, "n_test": config.n_test, "num_classes": toy.NUM_CLASSES,
        "requested_device": args.device, "device": str(device),
        "directml": {"available": dml_ok, "reason": dml_reason},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    stream = sys.stderr if args.json else sys.stdout  # with --json, stdout carries only the JSON
    print(format_header(header), file=stream, flush=True)
    impls = ["dml_optim", "torch"] if args.compare_torch else ["dml_optim"]
    results = []
    for impl in impls:
        with Progress("torch.optim" if impl == "torch" else "dml_optim", config.steps, stream=stream) as progress:
            results.append(train(config, device=device, impl=impl, progress_every=progress.every,
                                 progress=lambda step, steps, loss: progress.update(step, f"batch loss {loss:.4f}")))
    if args.json:
        print(json.dumps({**header, "runs": [r.to_dict() for r in results]}, indent=2))
    else:
        print(format_summary(results))
    return 0
