"""The largest GPT that trains in a memory budget, measured: ``python -m dml_optim.benchmark.fits``.

For each configuration (torch.optim.AdamW FP32, and dml_optim's leanest: bf16 parameters, stochastic
rounding, 8-bit or 4-bit state, the step inside backward, on DirectML's eager path) it finds the deepest
GPT of a fixed width whose whole-training peak fits ``--budget-gb`` of tensors: the peak of real training
steps above the memory before the model existed (:mod:`dml_optim.benchmark.wholemem`'s measurement, one
subprocess per model, ``zero_grad(set_to_none=True)``: what accelerate and the Trainer run).

The search measures two depths, fits the peak as a line in the depth (every block adds the same
parameters, states and activations), then measures the predicted depth and its neighbours until a depth
fits and the next one does not: every depth reported was measured, the line only chooses which to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Callable

from dml_optim.benchmark.wholemem import ModelSpec, config, measure_one

__all__ = ["WIDTH_SPEC", "CONFIGS", "largest_fitting", "measure", "main"]

#: The GPT family searched: every field but the depth fixed.
WIDTH_SPEC = dict(kind="gpt", width=1024, batch=1, vocab=8192, heads=16, seq=32)
#: The configurations compared (keys of :data:`dml_optim.benchmark.wholemem.CONFIGS`).
CONFIGS = ("torch-fp32", "ours-bf16-sr-8bit-eager-backward", "ours-bf16-sr-4bit-eager-backward")


def _spec(depth: int) -> dict[str, Any]:
    return dict(WIDTH_SPEC, name=f"gpt-{WIDTH_SPEC['width']}x{depth}", depth=depth)


def largest_fitting(peak_of: Callable[[int], int], budget: int, probes: tuple[int, int] = (2, 6),
                    limit: int = 256) -> tuple[int, dict[int, int]]:
    """``(the deepest depth whose peak fits budget, every measured {depth: peak})``; 0 when even depth 1 does
    not fit.  ``peak_of(depth)`` measures; a line through ``probes`` picks the first depth to try."""
    peaks: dict[int, int] = {}

    def peak(d: int) -> int:
        if d not in peaks:
            peaks[d] = peak_of(d)
        return peaks[d]

    a, b = probes
    slope = (peak(b) - peak(a)) / (b - a)
    guess = a + math.floor((budget - peak(a)) / slope) if slope > 0 else limit
    d = max(1, min(limit, guess))
    while d > 1 and peak(d) > budget:
        d -= 1
    if peak(d) > budget:
        return 0, peaks
    while d < limit and peak(d + 1) <= budget:
        d += 1
    return d, peaks


def measure(budget_gb: float = 2.0, configs: tuple[str, ...] = CONFIGS, log: Callable[[str], None] = print,
            timeout: float = 3600.0, out: Path | None = None) -> dict[str, Any]:
    """The document (written to ``out`` after each configuration too, when given)."""
    budget = int(budget_gb * 1e9)
    rows = []
    for key in configs:
        cfg = config(key)
        params: dict[int, int] = {}

        def peak_of(depth: int) -> int:
            result = measure_one({"config": key, "model": _spec(depth), "set_to_none": True, "device": "cpu",
                                  "warmup": 1, "steps": 1}, timeout=timeout)
            if "error" in result:
                raise RuntimeError(f"{key} at depth {depth}: {result['error']}")
            params[depth] = result["params"]
            log(f"  {key}: depth {depth}, {result['params'] / 1e6:.1f}M parameters, peak "
                f"{result['peak_bytes'] / 1e9:.3f} GB")
            return result["peak_bytes"]

        depth, peaks = largest_fitting(peak_of, budget)
        rows.append({"config": key, "label": cfg.label, "depth": depth, "params": params.get(depth, 0),
                     "peak_bytes": peaks.get(depth), "next_peak_bytes": peaks.get(depth + 1),
                     "measured": {str(d): {"peak_bytes": p, "params": params[d]} for d, p in sorted(peaks.items())}})
        log(f"{cfg.label}: depth {depth}, {params.get(depth, 0) / 1e6:.1f}M parameters in {budget_gb:g} GB")
        doc = _document(rows, budget)
        if out is not None:
            out.write_text(json.dumps(doc, indent=1) + "\n")
    return _document(rows, budget)


def _document(rows: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    from dml_optim.benchmark.machine import describe
    import torch

    base = next((r for r in rows if r["config"] == "torch-fp32"), None)
    for r in rows:
        r["ratio_to_torch"] = (r["params"] / base["params"]) if base and base["params"] else None
    return {"schema": "dml-optim-fits/1", "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": describe(torch.device("cpu")), "versions": {"torch": torch.__version__},
            "budget_bytes": budget, "family": dataclasses.asdict(ModelSpec(**_spec(0))) | {"depth": "searched"},
            "method": "wholemem's peak above the memory before the model (VmHWM), set_to_none=True, 1 warm-up and "
                      "1 measured step per depth; the deepest depth measured to fit, the next measured not to",
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dml_optim.benchmark.fits", description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=2.0, help="tensor memory budget in GB (default 2)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="wholemem configuration keys")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON document here")
    args = parser.parse_args(argv)
    if args.budget_gb <= 0:
        parser.error(f"--budget-gb must be > 0, got {args.budget_gb}")
    measure(args.budget_gb, tuple(args.configs), out=args.out)
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
