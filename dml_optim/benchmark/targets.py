"""The issues' targets, checked against a result document: each with the value measured and PASS/MISS.

"dml_optim" in a speed target means what ``backend="auto"`` (the default)
runs for that buffer size on that device.  A target whose row was not
measured (not selected, n/a, failed, cut by ``--budget``) is "not measured".
"""

from __future__ import annotations

from typing import Any, Callable

from dml_optim.benchmark.memory import CPU_SLACK
from dml_optim.benchmark.timing import reference_name

__all__ = ["check_targets", "speed_row", "reference"]

#: CUDA: dml_optim (auto) >= 1.0x torch fused (wall) for these optimizers and workloads ...
_CUDA_VS_FUSED = (("adam", "momentum"), ("resnet50", "bert-base-uncased", "gpt2", "one-256m"))
#: ... and >= 90% of the copy bandwidth on these.
_CUDA_COPY = (("adam", "momentum"), ("gpt2", "one-256m"), 0.9)
_TITLE = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "momentum": "Momentum"}


def speed_row(doc: dict[str, Any], optimizer: str, work: str, candidate: str) -> dict | None:
    """The speed row of (``optimizer``, ``work``, ``candidate``), or None."""
    return next((r for r in doc["results"] if (r["optimizer"], r["workload"], r["candidate"]) == (optimizer, work, candidate)), None)


def reference(doc: dict[str, Any], optimizer: str, work: str) -> dict | None:
    """The reference record of the (``optimizer``, ``work``) speed row, or None."""
    return next((r for r in doc["references"] if (r["optimizer"], r["workload"]) == (optimizer, work)), None)


def check_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target that applies to ``doc``'s device, in a fixed order."""
    device = doc["device"].split(":")[0]
    out: list[dict[str, Any]] = []

    def add(name: str, required: float, op: str, unit: str, value: float | None, backend: str | None = None) -> None:
        ok = None if value is None else (value >= required if op == ">=" else value <= required)
        out.append({"target": name, "required": required, "op": op, "unit": unit, "measured": value,
                    "dml_backend": backend, "pass": ok,
                    "status": "not measured" if ok is None else "PASS" if ok else "MISS"})

    def speed(name: str, optimizer: str, work: str, required: float, unit: str,
              measure: Callable[[dict, dict], float | None]) -> None:
        ref = reference(doc, optimizer, work)
        row = speed_row(doc, optimizer, work, f"dml_optim {ref['auto_backend']}") if ref else None
        value = measure(row, ref) if row is not None and row["ms_per_step"] is not None else None
        add(name, required, ">=", unit, value, ref["auto_backend"] if ref else None)

    def vs(candidate: str) -> Callable[[dict, dict], float | None]:
        def measure(row: dict, ref: dict) -> float | None:
            other = speed_row(doc, row["optimizer"], row["workload"], candidate)
            return None if other is None or other["ms_per_step"] is None else other["ms_per_step"] / row["ms_per_step"]
        return measure

    if device == "cpu":
        speed("resnet50 Adam >= 1.1x torch fused", "adam", "resnet50", 1.1, "x", vs("torch fused"))
        speed("resnet50 Adagrad >= 1.0x torch fused", "adagrad", "resnet50", 1.0, "x", vs("torch fused"))
        speed("resnet50 Momentum >= 1.0x torch fused (SGD)", "momentum", "resnet50", 1.0, "x", vs("torch fused"))
    elif device == "cuda":
        optimizers, works = _CUDA_VS_FUSED
        for w in works:
            for o in optimizers:
                speed(f"{w} {_TITLE[o]} >= 1.0x torch fused (wall)", o, w, 1.0, "x", vs("torch fused"))
    for o in ("adam", "adagrad", "momentum"):
        speed(f"many-small {_TITLE[o]} >= 3x torch foreach", o, "many-small", 3.0, "x", vs("torch foreach"))
    if device == "cuda":
        optimizers, works, share = _CUDA_COPY
        for w in works:
            for o in optimizers:
                speed(f"{w} {_TITLE[o]} >= {share:.0%} of the copy bandwidth (wall)", o, w, share, "fraction",
                      lambda row, ref: row["fraction_of_reference"])
    else:
        for o in ("adam", "adagrad", "momentum"):
            speed(f"one-64m {_TITLE[o]} >= 70% of {reference_name(doc)} bandwidth", o, "one-64m", 0.7, "fraction",
                  lambda row, ref: row["fraction_of_reference"])
    for row in doc.get("host_work", []):
        for checks in ("full", "fast"):
            add(f"host work, {_TITLE.get(row['optimizer'], row['optimizer'])}: 2000x16 <= {row['limit']:g}x 1x32000 "
                f"(checks={checks})", row["limit"], "<=", "x", row[f"ratio_{checks}"], "eager")
    for record in doc.get("lowbit", []):
        rows = {r["candidate"]: r for r in record["rows"]}
        ours, peer = rows["dml_optim 8-bit"], rows["bitsandbytes AdamW8bit" if device == "cpu" else "torch fused"]
        label = "bitsandbytes AdamW8bit" if device == "cpu" else "torch fused FP32 AdamW"
        value = (peer["ms_per_step"] / ours["ms_per_step"]
                 if ours["ms_per_step"] is not None and peer["ms_per_step"] is not None else None)
        add(f"{record['workload']} AdamW 8-bit >= 1.0x {label}", 1.0, ">=", "x", value, ours.get("backend"))
    for row in doc.get("instances", []):
        add(f"12th compiled Adam instance <= {row['limit']:g}x the 2nd", row["limit"], "<=", "x", row["ratio"], "compiled")
    for graph in doc.get("graphs", []):
        mine = next((r for r in graph["rows"] if r["candidate"] == f"dml_optim {graph['auto_backend']}" and r["mode"] == "graph"), None)
        add(f"{graph['workload']} Adam in a CUDA graph <= {graph['limit_ms']:g} ms per step", graph["limit_ms"], "<=", "ms",
            None if mine is None else mine["ms_per_step"], graph["auto_backend"])
    for row in doc.get("memory", []):
        if row["pack_via"] == "auto":
            bound = (f"; one copy + the largest tensor ({row['largest_share']:.0%}) + {CPU_SLACK:g}"
                     if row["device"] == "cpu" and "largest_share" in row else "")
            add(f"{row['workload']} construction peak <= {row['limit']:g}x trainable bytes (pack_via=auto, "
                f"{row['counter']}{bound})", row["limit"], "<=", "x", row["peak_ratio"])
    return out
