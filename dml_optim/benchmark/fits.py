"""The largest GPT that trains in a memory budget, measured: ``python -m dml_optim.benchmark.fits``.

For each configuration (torch.optim.AdamW FP32, and DirectML's lean configuration: float16 parameters,
stochastic rounding, 8-bit or 4-bit state, the eager backend and the step inside backward with the loss
scaled inside backward by a :class:`dml_optim.DynamicLossScaler`) it finds the deepest GPT of a fixed
width whose whole-training peak fits ``--budget-gb`` of tensors: the peak of real training steps above
the memory before the model existed (:mod:`dml_optim.benchmark.wholemem`'s measurement, one subprocess
per model, ``zero_grad(set_to_none=True)``: what accelerate and the Trainer run).  (Until 2026-12 the lean
rows were bfloat16, which DirectML does not have: ``--configs ours-bf16-sr-8bit-eager-backward`` still
measures them.)

The search measures two depths, fits the peak as a line in the depth (every block adds the same
parameters, states and activations), then measures the predicted depth and its neighbours until a depth
fits and the next one does not: every depth reported was measured, the line only chooses which to measure.

**Extrapolated, not measured** (:func:`extrapolate`, the document's ``extrapolated``): for larger budgets
(``--extrapolate-gb``, default 8, 12 and 24 GB: the cards' sizes; a card's usable memory is smaller) a
least-squares line ``peak(d) = a + b d`` through the measured depths from the second probe on (the first
probe, depth 2, is left out: below 64M parameters the eager step's scratch is a fixed 32 MiB, above it 0.5
bytes per parameter, so the line's regime starts there) gives the deepest depth ``floor((budget - a) /
b)`` and its parameters.  ``--verify-gb`` measures the predicted depth of those budgets (where this
machine's memory holds it), and the document says how far the line was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Callable

from dml_optim.benchmark.wholemem import LEAN_FP16, ModelSpec, config, count_params, measure_one

__all__ = ["WIDTH_SPEC", "CONFIGS", "EXTRAPOLATE_GB", "largest_fitting", "fit_line", "extrapolate", "params_at", "measure",
           "main"]

#: The GPT family searched: every field but the depth fixed.
WIDTH_SPEC = dict(kind="gpt", width=1024, batch=1, vocab=8192, heads=16, seq=32)
#: The configurations compared (keys of :data:`dml_optim.benchmark.wholemem.CONFIGS`): torch's FP32 reference and
#: DirectML's float16 lean configuration (:data:`dml_optim.benchmark.wholemem.LEAN_FP16`).
CONFIGS = ("torch-fp32", *LEAN_FP16)
#: The budgets (GB, 1e9 bytes of tensors) the measured line is extrapolated to: 8, 12 and 24 GB cards.
EXTRAPOLATE_GB = (8.0, 12.0, 24.0)
#: The depths the search measures first (the line that picks the first depth to try).
PROBES = (2, 6)


def _spec(depth: int) -> dict[str, Any]:
    return dict(WIDTH_SPEC, name=f"gpt-{WIDTH_SPEC['width']}x{depth}", depth=depth)


def largest_fitting(peak_of: Callable[[int], int], budget: int, probes: tuple[int, int] = PROBES,
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


def fit_line(points: dict[int, int]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``peak = a + b * depth`` through ``points`` ({depth: peak}, at least
    two depths)."""
    if len(points) < 2:
        raise ValueError(f"a line needs two measured depths, got {sorted(points)}")
    xs, ys = list(points), [points[d] for d in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def params_at(depth: int) -> int:
    """The parameters of the family's GPT of ``depth`` blocks."""
    return count_params(ModelSpec(**_spec(depth)))


def extrapolate(row: dict[str, Any], budgets_gb: tuple[float, ...] = EXTRAPOLATE_GB,
                from_depth: int = PROBES[1]) -> dict[str, Any]:
    """The deepest depth the measured line of ``row`` (a document row: ``measured`` {depth: {peak_bytes}})
    predicts for each budget: the least-squares line through the measured depths >= ``from_depth``.
    Extrapolated, not measured."""
    points = {int(d): m["peak_bytes"] for d, m in row["measured"].items() if int(d) >= from_depth}
    a, b = fit_line(points)
    out = []
    for gb in budgets_gb:
        depth = max(0, math.floor((gb * 1e9 - a) / b))
        out.append({"budget_gb": gb, "depth": depth, "params": params_at(depth) if depth else 0,
                    "predicted_peak_bytes": round(a + b * depth)})
    residual = max(abs(p - (a + b * d)) for d, p in points.items())
    return {"config": row["config"], "label": row["label"], "intercept_bytes": round(a), "bytes_per_block": round(b),
            "points": sorted(points), "max_residual_bytes": round(residual),
            "formula": f"depth = floor((budget - {a / 1e9:.4f} GB) / {b / 1e6:.2f} MB)", "budgets": out}


def measure(budget_gb: float = 2.0, configs: tuple[str, ...] = CONFIGS, log: Callable[[str], None] = print,
            timeout: float = 3600.0, out: Path | None = None, extrapolate_gb: tuple[float, ...] = EXTRAPOLATE_GB,
            verify_gb: tuple[float, ...] = ()) -> dict[str, Any]:
    """The document (written to ``out`` after each configuration too, when given)."""
    budget = int(budget_gb * 1e9)
    rows, lines = [], []
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
        row = {"config": key, "label": cfg.label, "directml": cfg.directml, "depth": depth,
               "params": params.get(depth, 0), "peak_bytes": peaks.get(depth), "next_peak_bytes": peaks.get(depth + 1),
               "measured": {str(d): {"peak_bytes": p, "params": params[d]} for d, p in sorted(peaks.items())}}
        rows.append(row)
        log(f"{cfg.label}: depth {depth}, {params.get(depth, 0) / 1e6:.1f}M parameters in {budget_gb:g} GB")
        if extrapolate_gb:
            line = extrapolate(row, extrapolate_gb)
            for b in line["budgets"]:
                if b["budget_gb"] in verify_gb and b["depth"]:
                    b["verified"] = {"depth": b["depth"], "peak_bytes": peak_of(b["depth"]),
                                     "params": params[b["depth"]]}
            lines.append(line)
            log(f"  extrapolated ({line['formula']}): " + ", ".join(
                f"{b['budget_gb']:g} GB -> depth {b['depth']} ({b['params'] / 1e6:.0f}M)" for b in line["budgets"]))
        doc = _document(rows, budget, lines)
        if out is not None:
            out.write_text(json.dumps(doc, indent=1) + "\n")
    return _document(rows, budget, lines)


def _document(rows: list[dict[str, Any]], budget: int, lines: list[dict[str, Any]] = ()) -> dict[str, Any]:
    from dml_optim.benchmark.machine import describe
    import torch

    base = next((r for r in rows if r["config"] == "torch-fp32"), None)
    for r in rows:
        r["ratio_to_torch"] = (r["params"] / base["params"]) if base and base["params"] else None
    doc = {"schema": "dml-optim-fits/1", "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": describe(torch.device("cpu")), "versions": {"torch": torch.__version__},
           "budget_bytes": budget, "family": dataclasses.asdict(ModelSpec(**_spec(0))) | {"depth": "searched"},
           "method": "wholemem's peak above the memory before the model (VmHWM), set_to_none=True, 1 warm-up and "
                     "1 measured step per depth; the deepest depth measured to fit, the next measured not to",
           "rows": rows}
    if lines:
        doc["extrapolated"] = {
            "method": "extrapolated, not measured: a least-squares line peak(depth) = a + b * depth through each row's "
                      f"measured depths >= {PROBES[1]} (depth {PROBES[0]} left out: below 64M parameters the eager "
                      "step's scratch is a fixed 32 MiB, 0.5 B/param above); the deepest depth is floor((budget - a) / "
                      "b), a budget in 1e9 bytes of tensors (a card's usable memory is less than its size); "
                      "'verified', where present, is a measurement of that depth",
            "rows": list(lines)}
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dml_optim.benchmark.fits", description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=2.0, help="tensor memory budget in GB (default 2)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="wholemem configuration keys")
    parser.add_argument("--extrapolate-gb", type=float, nargs="*", default=list(EXTRAPOLATE_GB),
                        help="budgets (GB) the measured line is extrapolated to (default: 8 12 24; none: no extrapolation)")
    parser.add_argument("--verify-gb", type=float, nargs="*", default=[],
                        help="of those budgets, measure the predicted depth (needs that much memory here)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON document here")
    args = parser.parse_args(argv)
    if args.budget_gb <= 0:
        parser.error(f"--budget-gb must be > 0, got {args.budget_gb}")
    if not set(args.verify_gb) <= set(args.extrapolate_gb):
        parser.error("--verify-gb: each budget must be one of --extrapolate-gb")
    measure(args.budget_gb, tuple(args.configs), out=args.out, extrapolate_gb=tuple(args.extrapolate_gb),
            verify_gb=tuple(args.verify_gb))
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
