"""Long FP16 run: ``dml_optim.Adam`` with the recommended FP16 settings, and with Kahan compensation, vs FP32.

Usage::

    python bench/long_run_fp16.py [--steps 20000] [--seed 0] [--batch-size 128]
                                  [--configs fp32,fp16-master,fp16-kahan,fp16-storage,fp32-8bit,...] [--out FILE]

Trains the built-in model (``dml_optim.job.toy``: 10-arm spiral, MLP 32-128-128-10)
with the same seed, the same initial weights (cast) and the same mini-batches
in each configuration, and compares the final training loss (mean
cross-entropy over the whole training set, evaluated in float32 arithmetic so
that the configurations are measured alike) with the FP32 run's.

Configurations (hyperparameters identical: lr 1e-3, alpha 0.9, beta 0.999,
epsilon 1e-6):

* ``fp32``: float32 model, float32 Adam (the reference).
* ``fp16-master`` (**the recommended FP16 setting**, from the facts in issue 6):
  float16 model (forward and backward in float16), ``Adam(master_weights=True)``
  (float32 master weights, float32 moments, float32 arithmetic: epsilon 1e-6
  does not underflow, the second moment does not flush, updates below half an
  FP16 ULP accumulate in the master copy) and ``dml_optim.training.amp.DynamicLossScaler``
  (gradients of the float16 backward scaled into range; an overflow step is
  skipped exactly on the device).  The loss is computed in float32 from the
  float16 logits.
* ``fp16-kahan``: float16 model, ``Adam(kahan=True)`` (float16 parameters plus
  a float16 compensation buffer that carries what rounding the parameters
  drops; float32 moments and arithmetic: 2 bytes per parameter for the
  weights' precision instead of the master copy's 4) and the same loss
  scaler.  Held to the same tolerance as ``fp16-master``.
* ``fp16-storage``: float16 model and float16 moments with float32 compute
  (chunked), epsilon 1e-4 (>= 6e-8, so it survives in float16), the same loss
  scaler, no master copy: cheaper, but updates below half an FP16 ULP of a
  weight are lost.  Reported for comparison.
* ``fp32-8bit``, ``fp32-4bit``: the float32 model with the moments stored
  block-quantized in 8 or 4 bits (``state_bits``; tensors under 4096 elements
  keep float32 moments).
* ``fp16-kahan-8bit``, ``fp16-kahan-4bit``: ``fp16-kahan`` with 8- or 4-bit
  moments: the smallest footprint (2 + 2 bytes of parameters and compensation,
  about 2 or 1 of state, per parameter).
* ``fp16-sr``, ``fp16-sr-8bit``, ``fp16-sr-4bit``: the float16 model with
  ``rounding="stochastic"`` (float32 moments and arithmetic, the result rounded
  into the float16 parameters up or down with the probabilities that make it
  unbiased: no compensation buffer) and full, 8- or 4-bit moments; the same
  loss scaler.  Reported beside ``fp16-kahan`` (not held to the tolerance).
* ``bf16-sr-8bit``, ``bf16-sr-8bit-backward``: the bfloat16 model with
  ``rounding="stochastic"`` and 8-bit moments, no loss scaler (bf16 has
  float32's range); ``-backward`` steps inside backward
  (:func:`dml_optim.step_in_backward`): the leanest whole-training configuration.

Documented tolerance (checked by ``tests/test_long_run.py`` on a short run and
reported here for the full one): every logged loss and every parameter stays
finite, and ``|final_loss(c) - final_loss(fp32)| <= ABS_TOL + REL_TOL
* final_loss(fp32)`` for ``c`` in :data:`HELD_TO_TOLERANCE` (``fp16-master``
and ``fp16-kahan``); the exit status is 1 otherwise.  The table also gives
each configuration's gap to ``fp16-master``.

Prints a summary table and writes JSON (``--out``, default
``dml-optim-out/long_run_fp16.json`` under the current folder, where
``dml-optim compare`` and ``bench`` write too).  Single-threaded torch by
default (``--threads``), so runs on a shared machine are reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dml_optim
from dml_optim.job import toy
from dml_optim.training.amp import DynamicLossScaler
from dml_optim.console import DEFAULT_OUTPUT_DIR

#: Tolerance on the final training loss of ``fp16-master`` against ``fp32`` (see the docstring).
ABS_TOL = 0.02
REL_TOL = 0.10

HYPER = dict(lr=1e-3, alpha=0.9, beta=0.999, epsilon=1e-6)
CONFIGS = ("fp32", "fp16-master", "fp16-kahan", "fp16-storage", "fp32-8bit", "fp32-4bit", "fp16-kahan-8bit",
           "fp16-kahan-4bit", "fp16-sr", "fp16-sr-8bit", "fp16-sr-4bit", "bf16-sr-8bit", "bf16-sr-8bit-backward")
#: The configurations whose final loss must be within the tolerance of ``fp32``'s.
HELD_TO_TOLERANCE = ("fp16-master", "fp16-kahan", "fp32-8bit", "fp16-kahan-8bit")
#: Where the JSON goes unless ``--out`` says otherwise (relative to the current folder).
DEFAULT_OUT = DEFAULT_OUTPUT_DIR / "long_run_fp16.json"


def batch_indices(n_train: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """``(steps, batch_size)`` indices: shuffled epochs from a seeded CPU generator (shared by all runs)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    per_epoch = n_train // batch_size
    epochs = -(-steps // per_epoch)
    rows = [torch.randperm(n_train, generator=gen)[: per_epoch * batch_size].view(per_epoch, batch_size)
            for _ in range(epochs)]
    return torch.cat(rows)[:steps]


def build(config: str, seed: int, init_scale: float = 2.0**16):
    """(model, optimizer, scaler or None, parameter dtype) of a configuration."""
    if config in ("fp32", "fp32-8bit", "fp32-4bit"):
        model = toy.make_model(seed)
        bits = {"fp32-8bit": 8, "fp32-4bit": 4}.get(config)
        return model, dml_optim.Adam(model.parameters(), state_bits=bits, **HYPER), None, torch.float32
    if config in ("bf16-sr-8bit", "bf16-sr-8bit-backward"):  # (bf16's range: no loss scaler)
        model = toy.make_model(seed, dtype=torch.bfloat16)
        torch.manual_seed(seed)
        opt = dml_optim.Adam(model.parameters(), rounding="stochastic", state_bits=8, **HYPER)
        if config.endswith("-backward"):
            dml_optim.step_in_backward(opt)  # (the loop's opt.step() after backward then steps nothing)
        return model, opt, None, torch.bfloat16
    model = toy.make_model(seed, dtype=torch.float16)
    if config == "fp16-master":
        opt = dml_optim.Adam(model.parameters(), master_weights=True, **HYPER)
    elif config in ("fp16-kahan", "fp16-kahan-8bit", "fp16-kahan-4bit"):
        bits = {"fp16-kahan-8bit": 8, "fp16-kahan-4bit": 4}.get(config)
        opt = dml_optim.Adam(model.parameters(), kahan=True, state_bits=bits, **HYPER)
    elif config in ("fp16-sr", "fp16-sr-8bit", "fp16-sr-4bit"):
        bits = {"fp16-sr-8bit": 8, "fp16-sr-4bit": 4}.get(config)
        torch.manual_seed(seed)  # (the rounding generator is seeded from torch.initial_seed())
        opt = dml_optim.Adam(model.parameters(), rounding="stochastic", state_bits=bits, **HYPER)
    elif config == "fp16-storage":
        opt = dml_optim.Adam(model.parameters(), compute_dtype=torch.float32, **dict(HYPER, epsilon=1e-4))
    else:
        raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {config!r}")
    return model, opt, DynamicLossScaler(init_scale=init_scale), torch.float16


@torch.no_grad()
def native_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy over ``x`` as the model computes it (its dtype; the loss itself in float32)."""
    dtype = next(model.parameters()).dtype
    return float(F.cross_entropy(model(x.to(dtype)).float(), y))


@torch.no_grad()
def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy over ``x`` with float32 arithmetic (a float32 copy of the model)."""
    ref = toy.make_model(0, hidden=model[0].out_features)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return float(F.cross_entropy(ref(x.float()), y))


def run(config: str, *, steps: int, seed: int = 0, batch_size: int = 128, log_every: int = 500,
        data=None, progress=None, init_scale: float = 2.0**16) -> dict[str, Any]:
    """Train one configuration; returns its summary (losses, skips, final loss, finiteness)."""
    x_train, y_train, x_test, y_test = data if data is not None else toy.make_dataset(seed)
    model, opt, scaler, dtype = build(config, seed, init_scale)
    xs = x_train.to(dtype)
    batches = batch_indices(x_train.shape[0], batch_size, steps, seed)
    log, window, skipped, finite_losses = [], [], 0, True
    start = time.perf_counter()
    for t in range(steps):
        idx = batches[t]
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]).float(), y_train[idx])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            skipped += int(scaler.step(opt).item())  # a host sync: fine on the CPU, for the statistics
            scaler.update()
        window.append(float(loss.detach()))
        if (t + 1) % log_every == 0 or t + 1 == steps:
            mean = sum(window) / len(window)
            finite_losses &= math.isfinite(mean)
            log.append({"step": t + 1, "mean_batch_loss": mean})
            window = []
            if progress:
                progress(config, t + 1, mean)
    seconds = time.perf_counter() - start
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "config": config,
        "steps": steps,
        "seconds": round(seconds, 2),
        "skipped_steps": skipped,
        "final_scale": scaler.get_scale() if scaler is not None else None,
        "params_finite": params_finite,
        "losses_finite": finite_losses,
        "final_loss": full_loss(model, x_train, y_train),
        "final_loss_native": native_loss(model, x_train, y_train),
        "test_accuracy": toy.accuracy(model, x_test.to(dtype), y_test),
        "log": log,
    }


def within_tolerance(loss: float, reference: float) -> bool:
    return math.isfinite(loss) and abs(loss - reference) <= ABS_TOL + REL_TOL * reference


def compare(steps: int, *, seed: int = 0, batch_size: int = 128, configs=CONFIGS, log_every: int = 500,
            progress=None) -> dict[str, Any]:
    data = toy.make_dataset(seed)
    results = {c: run(c, steps=steps, seed=seed, batch_size=batch_size, log_every=log_every, data=data,
                      progress=progress) for c in configs}
    ref = results["fp32"]["final_loss"] if "fp32" in results else None
    master = results["fp16-master"]["final_loss"] if "fp16-master" in results else None
    for r in results.values():
        if ref is not None:
            r["loss_diff_vs_fp32"] = r["final_loss"] - ref
            r["within_tolerance"] = within_tolerance(r["final_loss"], ref)
        if master is not None:
            r["loss_diff_vs_fp16_master"] = r["final_loss"] - master
    return {
        "benchmark": "long_run_fp16",
        "steps": steps, "seed": seed, "batch_size": batch_size, "hyperparameters": HYPER,
        "tolerance": {"abs": ABS_TOL, "rel": REL_TOL, "rule": "|loss - loss_fp32| <= abs + rel * loss_fp32"},
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "dml_optim": dml_optim.__version__},
        "results": results,
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"{'config':<14} {'final loss':>11} {'diff vs fp32':>13} {'ok':>4} {'diff vs fp16-master':>19} "
             f"{'native loss':>12} {'test acc':>9} {'skipped':>8} {'finite':>7} {'seconds':>8}"]
    for r in report["results"].values():
        diff, diff_master = r.get("loss_diff_vs_fp32"), r.get("loss_diff_vs_fp16_master")
        lines.append(
            f"{r['config']:<14} {r['final_loss']:>11.5f} {'' if diff is None else f'{diff:+.5f}':>13} "
            f"{'yes' if r.get('within_tolerance', True) else 'NO':>4} "
            f"{'' if diff_master is None else f'{diff_master:+.5f}':>19} {r['final_loss_native']:>12.5f} "
            f"{r['test_accuracy']:>9.4f} "
            f"{r['skipped_steps']:>8d} {str(r['params_finite'] and r['losses_finite']):>7} {r['seconds']:>8.1f}")
    tol = report["tolerance"]
    lines.append(f"tolerance: {tol['rule']} (abs {tol['abs']}, rel {tol['rel']}); final loss: whole training "
                 "set, float32 arithmetic; native loss: in the model's own dtype")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help=f"JSON output file (default: ./{DEFAULT_OUT}, relative to the current folder)")
    args = parser.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    bad = [c for c in configs if c not in CONFIGS]
    if bad or args.steps < 1 or args.batch_size < 1 or args.log_every < 1:
        parser.error(f"bad value: configs {bad}" if bad else "--steps, --batch-size and --log-every must be >= 1")
    torch.set_num_threads(args.threads)

    def progress(config, step, loss):
        print(f"  {config:<14} step {step:>6}  mean batch loss {loss:.5f}", flush=True)

    report = compare(args.steps, seed=args.seed, batch_size=args.batch_size, configs=configs,
                     log_every=args.log_every, progress=progress)
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    ok = all(r["params_finite"] and r["losses_finite"] and r.get("within_tolerance", True)
             for r in report["results"].values() if r["config"] in ("fp32",) + HELD_TO_TOLERANCE)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
