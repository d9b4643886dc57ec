"""The result document as text and as a file: markdown tables, a compact summary, the JSON.

:func:`format_report` prints every section of a document (speed rows, the
bandwidth references with their passes' GB/s where recorded, compile times,
memory, CUDA graphs, instances, host work, None patterns, construction,
the loops people run (CPU and DirectML's eager path), failures, what was not measured and why, targets);
:func:`format_summary` one line per speed measurement (what ``backend="auto"``
runs beside torch.optim) and the targets.  Where a table names what ``auto``
ran it shows the record's ``auto_runs`` (``fused`` on the CPU;
:func:`~dml_optim.benchmark.targets.auto_label`), or its ``auto_backend`` in
documents recorded before that field; a host row of such a document (eager,
``checks`` full and fast) keeps its table.  The tables of the memory, graph,
instances, host, None-pattern and construction rows, of the targets, and
:func:`target_cells` (a row's targets in a table cell) are public:
``tools/readme_tables.py`` puts them in the README.  :func:`write_json` writes the document; :func:`default_output_path`
is where.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from dml_optim.benchmark.candidates import AUTO
from dml_optim.benchmark.nonepattern import MODES, find_row
from dml_optim.benchmark.targets import auto_label, reference, speed_row, versus
from dml_optim.benchmark.timing import reference_name
from dml_optim.console import DEFAULT_OUTPUT_DIR

__all__ = ["format_report", "format_summary", "speed_table", "memory_table", "graph_table", "instances_table", "host_table",
           "lowbit_table", "nonepattern_table", "construction_table", "loops_table", "eager_loops_table", "target_cells", "targets_table", "ratio_cell",
           "not_measured_lines", "default_output_path", "write_json"]


def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _table(header: list[str], rows: list[list[str]], right: int, left_last: int = 0) -> list[str]:
    """A markdown table; columns from ``right`` on are right-aligned, except the last ``left_last``."""
    align = ["---:" if right <= i < len(header) - left_last else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def _header(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    where = m.get("gpu") or m.get("cpu_model", m.get("processor"))
    return (f"device: {doc['device']} ({where}; {m.get('cpu_count')} CPUs, torch {m['torch']}, {doc['dtype']}), "
            f"{doc['created']}{'' if doc['complete'] else ' (incomplete)'}, {doc['elapsed_s']:.0f} s")


def speed_table(doc: dict[str, Any]) -> list[str]:
    """The speed rows of a bench document as report lines (none where it has no results)."""
    if not doc["results"]:
        return []
    kernels = any(r["kernel_ms"] is not None for r in doc["results"])
    share = f"% of {reference_name(doc)}"
    header = ["optimizer", "workload", "candidate", "ms/step", "vs best torch", "GB/s", share]
    header += ["kernel ms", f"kernel {share}"] if kernels else []
    header += ["ops/step", "optimizer MB", "first step ms"]
    rows = []
    for r in doc["results"]:
        ref = reference(doc, r["optimizer"], r["workload"])
        name = r["candidate"] + (_auto_mark(ref) if ref and r["candidate"] == f"dml_optim {ref['auto_backend']}" else "")
        if r["ms_per_step"] is None:
            rows.append([r["optimizer"], r["workload"], name, "n/a"] + [""] * (len(header) - 4))
            continue
        cells = [r["optimizer"], r["workload"], name, f"{r['ms_per_step']:.3f}", _f(r["ratio_to_best_torch"], ".2f", "x"),
                 f"{r['gbs']:.1f}", _pct(r["fraction_of_reference"])]
        if kernels:
            cells += [_f(r["kernel_ms"], ".3f"), _pct(r["kernel_fraction_of_reference"])]
        cells += [_f(r["ops_per_step"], "d"), _f(None if r["optimizer_bytes"] is None else r["optimizer_bytes"] / 2**20, ".1f"),
                  f"{r['first_step_ms']:.1f}"]
        rows.append(cells)
    lines = _table(header, rows, 3)
    lines += ["", *_references_table(doc)]
    compiles = [r for r in doc["results"] if r["candidate"] == "dml_optim compiled" and r["compile_s"] is not None]
    if compiles:
        lines += ["", *_table(["compile time (first compiled step minus a steady one)", "workload", "s"],
                              [[r["optimizer"], r["workload"], f"{r['compile_s']:.2f}"] for r in compiles], 2)]
    return lines


def _references_table(doc: dict[str, Any]) -> list[str]:
    """One line per speed and frozen row's reference: its bandwidth (ms: a 3-element pass at it, for the stream
    limit), and where the record has them its passes' median GB/s, the fastest marked ``*``."""
    passes = any("reference_passes" in x for x in doc["references"])
    return _table(["bandwidth reference", "optimizer", "workload", "ms", "GB/s", "kernel GB/s"]
                  + (["passes GB/s (* fastest)"] if passes else []),
                  [[f"{x['reference']} of {x['reference_elements']:,}", x["optimizer"], x["workload"],
                    f"{x['reference_ms']:.3f}", f"{x['reference_gbs']:.1f}", _f(x["reference_kernel_gbs"], ".1f")]
                   + ([_passes_cell(x)] if passes else []) for x in doc["references"]], 3, left_last=int(passes))


def _passes_cell(record: dict[str, Any]) -> str:
    """``"add 52.6, sgd 56.7, adam 57.9*"``: each pass's median GB/s, the fastest (in most rounds) marked."""
    fastest = record.get("reference_fastest")
    return ", ".join(f"{name} {p['gbs']:.1f}{'*' if name == fastest else ''}"
                     for name, p in record.get("reference_passes", {}).items()) or "n/a"


def _auto_mark(ref: dict[str, Any]) -> str:
    """`` (auto)`` beside the row that is what ``backend="auto"`` runs; a row's own ``dml_optim auto`` candidate
    also says what it ran (`` (auto: fused)``), where the record knows."""
    ran = ref.get("auto_runs")
    return f" (auto: {ran})" if ref["auto_backend"] == "auto" and ran else " (auto)"


def memory_table(doc: dict[str, Any]) -> list[str]:
    """The memory row: peak and final memory of construction per model and ``pack_via``."""
    if not doc["memory"]:
        return []
    return _table(["construction memory", "pack_via", "counter", "trainable MB", "peak / trainable", "after / trainable"],
                  [[r["workload"], r["pack_via"], r["counter"], f"{r['trainable_bytes'] / 2**20:.1f}",
                    f"{r['peak_ratio']:.2f}x", f"{r['after_ratio']:.2f}x"] for r in doc["memory"]], 3)


def graph_table(doc: dict[str, Any]) -> list[str]:
    """The CUDA-graph row: each candidate replayed in a graph and stepped plainly."""
    lines = []
    for g in doc["graphs"]:
        lines += _table([f"{g['workload']} Adam, capturable=True", "mode", "ms/step", "first step ms"],
                        [[r["candidate"] + (" (auto)" if r["candidate"] == f"dml_optim {g['auto_backend']}" else ""),
                          r["mode"], _f(r["ms_per_step"], ".4f") if r["available"] else f"n/a ({r['reason']})",
                          _f(r["first_step_ms"], ".1f")] for r in g["rows"]], 2)
    return lines


def instances_table(doc: dict[str, Any]) -> list[str]:
    """The instances row: the 12th compiled instance's step beside the 2nd's."""
    if not doc["instances"]:
        return []
    return _table(["instances (compiled Adam)", "workload", "2nd ms", "12th ms", "12th / 2nd", "graphs compiled"],
                  [[str(r["instances"]), r["workload"], f"{r['ms_2nd']:.4f}", f"{r['ms_12th']:.4f}", f"{r['ratio']:.2f}x",
                    str(r["graphs_compiled"])] for r in doc["instances"]], 2)


def host_modes(default: str) -> tuple[str, ...]:
    """The ``checks`` modes of a host row, the row's default (the target's) first."""
    return (default, *(c for c in ("full", "refs", "fast") if c != default))


def host_table(doc: dict[str, Any]) -> list[str]:
    """The host row: a step over 2,000 x 16 elements beside one over 1 x 32,000.  Today's rows: the default
    backend (what ``auto`` ran) with each ``checks`` mode, the row's default (the target's: ``"full"``; ``"refs"``
    in documents of 2026-11) first, and the eager chain (DirectML's) with the default checks; rows recorded before
    ``checks="refs"`` existed: eager, full and fast."""
    rows = doc["host_work"]
    if not rows:
        return []
    if not any("ratio_refs" in r for r in rows):
        return _table(["host work (eager, cpu, 1 thread)", "2000x16 us, checks=full", "checks=fast", "1x32000 us",
                       "full / one", "fast / one", "ops/step: 2000x16 / 1x32000"],
                      [[r["optimizer"], f"{r['us_many_full']:.0f}", f"{r['us_many_fast']:.0f}", f"{r['us_one']:.0f}",
                        f"{r['ratio_full']:.2f}x", f"{r['ratio_fast']:.2f}x",
                        f"{_f(r.get('ops_many_full'), 'd')} / {_f(r.get('ops_one'), 'd')}"] for r in rows], 1)
    modes = host_modes(rows[0]["checks"])
    return _table(["host work (cpu, 1 thread)", "backend (auto)",
                   f"2000x16 us: checks={modes[0]} (default) / {' / '.join(modes[1:])}", "1x32000 us",
                   *(f"{c} / one" for c in modes), f"eager 2000x16 / 1x32000 us (checks={modes[0]})",
                   "eager: 2000x16 / one", "ops/step: 2000x16 / 1x32000, eager"],
                  [[r["optimizer"], r.get("backend") or "n/a",
                    " / ".join(_f(r.get(f"us_many_{c}"), ".0f") for c in modes),
                    _f(r.get("us_one"), ".0f"),
                    *(_f(r.get(f"ratio_{c}"), ".2f", "x") for c in modes),
                    f"{_f(r.get('eager_us_many'), '.0f')} / {_f(r.get('eager_us_one'), '.0f')}",
                    _f(r.get("eager_ratio"), ".2f", "x"),
                    f"{_f(r.get(f'ops_many_{modes[0]}'), 'd')} / {_f(r.get('ops_one'), 'd')}, "
                    f"{_f(r.get('eager_ops_many'), 'd')} / {_f(r.get('eager_ops_one'), 'd')}"] for r in rows], 2)


def lowbit_table(doc: dict[str, Any]) -> list[str]:
    """The low-bit row: AdamW's step and state per parameter, ours at 8 and 4 bits beside torch and the peers."""
    if not doc.get("lowbit"):
        return []
    out = []
    for record in doc["lowbit"]:
        out += _table([f"AdamW, {record['workload']}", "ms per step", "vs torch fused", "state bytes per parameter",
                       "note"],
                      [[r["candidate"], _f(r["ms_per_step"], ".2f"), ratio_cell(r["ratio_to_fused"], r.get("ratio_spread")),
                        _f(r["state_bytes_per_param"], ".3g"),
                        (f"backend {r['backend']}" if r.get("backend") else "") if r["available"] else r["reason"]]
                       for r in record["rows"]], 3, 1)
    return out


def _spread(row: dict, key: str) -> str:
    """``"81.0 (25.6-124)"``: a median in ms with the fastest and slowest sample (``ms_min``, ``ms_max``)."""
    if row is None or row.get(key) is None:
        return "n/a"
    lo, hi = row.get("ms_min"), row.get("ms_max")
    return _ms3(row[key]) + ("" if lo is None or hi is None else f" ({_ms3(lo)}-{_ms3(hi)})")


def _ms3(value: float) -> str:
    """Three significant figures or so: 0.824, 9.48, 81.0, 176."""
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _x(ratio: float | None) -> str:
    """A ratio: ``"1.10x"``, ``"0.012x"`` below 0.1."""
    return "n/a" if ratio is None else f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.3f}x"


def _required(t: dict[str, Any]) -> str:
    req = t["required"]
    return f"{100 * req:.0f}% of" if t["unit"] == "fraction" else f"{req:g} ms" if t["unit"] == "ms" else f"{req:.1f}x"


def _status(t: dict[str, Any]) -> str:
    """``"PASS"``, ``"MISS"``, or ``"not measured (torch fused n/a)"``: the missing part, from the reason
    (the committed documents of 2026-11-23 record none)."""
    reason = t.get("reason")
    return t["status"] + (f" ({reason.split(': ')[0]})" if t["status"] == "not measured" and reason else "")


def target_cells(targets: list[dict[str, Any]], shown: set[str] | None = None) -> str:
    """A row's targets in one cell: ``">= 1.0x torch fused: PASS; >= 3.0x torch foreach: PASS"`` (not measured:
    the part that is missing).  Their names are added to ``shown``."""
    if shown is not None:
        shown.update(t["target"] for t in targets)
    return "; ".join(f"{t['op']} {_required(t)} {t['versus']}: {_status(t)}" for t in targets) or "none"


def _nonepattern_cells(rec: dict[str, Any], shown: set[str] | None) -> list[str]:
    """One optimizer's cells of the None-pattern table."""
    def row(candidate: str, mode: str) -> dict:
        return find_row(rec["rows"], candidate, mode) or {}

    def pair(candidate: str, key: str, spec: str) -> str:
        return " / ".join(_f(row(candidate, m).get(key), spec) for m in MODES)

    ran = f"{rec['auto_runs']}: " if rec.get("auto_runs") else ""  # (what auto ran, where the record says)
    return [rec["optimizer"], ran + _spread(row(AUTO, "changing"), "ms_per_step"),
            _spread(row(AUTO, "steady"), "ms_per_step"), ratio_cell(rec["ratio_changing_to_steady"], rec.get("spread_changing_to_steady")),
            *(_spread(row("torch fused", m), "ms_per_step") for m in MODES), ratio_cell(rec["ratio_fused_to_ours"], rec.get("spread_fused_to_ours")),
            pair("dml_optim eager", "ms_per_step", ".2f"), pair("dml_optim compiled", "ms_per_step", ".2f"),
            pair(AUTO, "ops_per_step", ".1f"), _f(row(AUTO, "changing").get("distinct_step_counts"), "d"),
            target_cells(rec.get("targets", []), shown)]


def nonepattern_table(doc: dict[str, Any], shown: set[str] | None = None) -> list[str]:
    """The None-pattern row: dml_optim (``auto``, then eager and compiled) and torch fused, changing patterns beside
    steady steps; ms per step as median (fastest-slowest), ops per step, and the targets (names added to ``shown``)."""
    records = doc.get("nonepattern") or []
    if not records:
        return []
    first = records[0]
    return _table([f"None gradients, {first['workload']}, {first['present']} of {first['tensors']} present",
                   "dml_optim (auto) changing ms", "steady ms", "changing / steady", "torch fused changing ms",
                   "steady ms", "torch fused / dml_optim, changing", "dml_optim eager ms: changing / steady",
                   "dml_optim compiled ms: changing / steady", "ops per step (auto): changing / steady",
                   "distinct step counts", "targets"],
                  [_nonepattern_cells(rec, shown) for rec in records], 1, left_last=1)


def construction_table(doc: dict[str, Any], shown: set[str] | None = None) -> list[str]:
    """The construction row: construction + first step, dml_optim's defaults beside torch fused (warm median
    (fastest-slowest), its two parts, the cold first time), and the targets (names added to ``shown``)."""
    rows = []
    for rec in doc.get("construction") or []:
        by = {r["candidate"]: r for r in rec["rows"]}
        ours, fused = by.get(AUTO) or {}, by.get("torch fused") or {}
        rows.append([rec["workload"], rec["optimizer"], f"{auto_label(rec)}: {_spread(ours, 'ms')}",
                     _spread(fused, "ms"), _x(rec["ratio"]),
                     f"{_f(ours.get('construct_ms'), '.1f')} / {_f(ours.get('first_step_ms'), '.1f')}",
                     f"{_f(fused.get('construct_ms'), '.1f')} / {_f(fused.get('first_step_ms'), '.1f')}",
                     f"{_f(ours.get('cold_s'), '.2f')} / {_f(fused.get('cold_s'), '.2f')}",
                     target_cells(rec.get("targets", []), shown)])
    if not rows:
        return []
    return _table(["construction + first step", "optimizer", "dml_optim ms (backend)", "torch fused ms",
                   "dml_optim / torch fused", "dml_optim ms: construction / first step",
                   "torch fused ms: construction / first step",
                   "cold s: dml_optim / torch fused", "targets"], rows, 2, left_last=1)


def _named_cells(targets: list[dict[str, Any]], shown: set[str] | None) -> str:
    """A row's targets in one cell by the part of their names after the row's own (``">= 1.0x torch fused:
    PASS"``); names added to ``shown``."""
    if shown is not None:
        shown.update(t["target"] for t in targets)
    return "; ".join(f"{t['target'].split(': ', 1)[-1]}: {_status(t)}" for t in targets) or "none"


def loops_table(doc: dict[str, Any], shown: set[str] | None = None) -> list[str]:
    """The loops people run (CPU, one thread, AdamW): dml_optim beside torch fused per model and loop, ms per
    iteration as median (fastest-slowest), the round-by-round ratio with its quartiles, and the targets."""
    rows = []
    for rec in doc.get("loops") or []:
        by = {r["candidate"]: r for r in rec["rows"]}
        rows.append([rec["model"], rec["loop"], f"{rec['tensors']} / {rec['parameters']:,}",
                     _spread(by.get("dml_optim") or {}, "ms_per_step"), _spread(by.get("torch fused") or {}, "ms_per_step"),
                     ratio_cell(rec["ratio_fused_to_ours"], rec.get("spread_fused_to_ours")),
                     _named_cells(rec.get("targets", []), shown)])
    if not rows:
        return []
    return _table(["loop model", "loop", "tensors / parameters", "dml_optim ms", "torch fused ms",
                   "torch fused / dml_optim", "targets"], rows, 3, left_last=1)


def eager_loops_table(doc: dict[str, Any], shown: set[str] | None = None) -> list[str]:
    """DirectML's path (``backend="eager"``, host time per step, 16-element tensors): each candidate's us per step
    as median (fastest-slowest), then the three ratios with their quartiles and the targets, then (where the record
    has them) the loops with a real ``backward()``, ms per iteration beside torch fused and torch's for-loop."""
    lines = []
    for rec in doc.get("loops_eager") or []:
        us = [[r["candidate"], f"{r['ms_per_step'] * 1e3:.1f} ({r['ms_min'] * 1e3:.1f}-{r['ms_max'] * 1e3:.1f})"]
              for r in rec["rows"]]
        many = rec["tensors_many"]

        def targets(prefix: str) -> list[dict[str, Any]]:
            return [t for t in rec.get("targets", []) if t["target"].startswith(prefix)]

        ratios = [("1 tensor / torch's for-loop AdamW, 1 tensor", ratio_cell(rec["ratio_to_forloop"], rec.get("spread_to_forloop")),
                   targets("eager steady step, 1 tensor:")),
                  ("lr changing / steady, 1 tensor", ratio_cell(rec["ratio_lr_change"], rec.get("spread_lr_change")),
                   targets("eager step with a new lr:")),
                  (f"{many} tensors / 1 tensor (default checks)", ratio_cell(rec["ratio_many"], rec.get("spread_many")),
                   targets(f"eager steady step, {many} tensors:")),
                  (f"{many} tensors / 1 tensor, checks=\"refs\" (information)",
                   ratio_cell(rec["ratio_many_refs"], rec.get("spread_many_refs")), [])]
        if "ratio_many_floor" in rec:  # (documents from cpu-2026-11-29-4.json on)
            ratios.append((f"{many} tensors, checks=\"refs\" + the reads of an exact check (a .grad and a data_ptr() per "
                           "parameter) / 1 tensor (information: the least an exact default reaches here)",
                           ratio_cell(rec["ratio_many_floor"], rec.get("spread_many_floor")), []))
        lines += [*_table(["eager step (DirectML's path)", "host us per step"], us, 1), "",
                  *_table(["eager ratio", "measured", "target"],
                          [[name, value, _named_cells(t, shown)] for name, value, t in ratios], 1, left_last=1)]
        loops = []
        for row in rec.get("loops") or []:  # (the loops with a real backward: information, no target)
            by = {r["candidate"]: r for r in row["rows"]}
            loops.append([row["model"], row["loop"], str(row["tensors"]),
                          *[_spread(by.get(c), "ms_per_step") for c in ("dml_optim", "torch fused", "torch for-loop")],
                          ratio_cell(row["ratio_fused_to_ours"], row.get("spread_fused_to_ours")),
                          ratio_cell(row["ratio_forloop_to_ours"], row.get("spread_forloop_to_ours"))])
        if loops:
            lines += ["", *_table(["loop model (16 per tensor)", "loop, with backward()", "tensors", "dml_optim eager ms",
                                   "torch fused ms", "torch for-loop ms", "torch fused / dml_optim",
                                   "torch for-loop / dml_optim"], loops, 2)]
    return lines


def ratio_cell(value: float | None, spread: list[float] | None) -> str:
    """``"1.02x (0.97-1.06)"``: a ratio taken round by round with its quartiles (``spread``; None: the ratio alone)."""
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + ("" if not spread else f" ({spread[0]:.2f}-{spread[1]:.2f})")


def _measured(t: dict[str, Any]) -> str:
    value = t["measured"]
    if value is None:
        return "n/a"
    if t["unit"] == "x":
        return ratio_cell(value, t.get("spread"))
    return f"{100 * value:.0f}%" if t["unit"] == "fraction" else f"{value:.3f} ms"


def targets_table(doc: dict[str, Any]) -> list[str]:
    """Every target: what dml_optim ran, the value measured, PASS / MISS / not measured (and what is missing)."""
    return _table(["target", "dml_optim backend", "measured", "status"],
                  [[t["target"], t["dml_backend"] or "", _measured(t), _status(t)] for t in doc["targets"]],
                  2, left_last=1)


def not_measured_lines(doc: dict[str, Any]) -> list[str]:
    """``not measured: WHAT: why`` per row or figure the run left out (absent in documents older than the list)."""
    return [f"not measured: {n['what']}: {n['reason']}" for n in doc.get("not_measured", [])]


def _failures(doc: dict[str, Any]) -> list[str]:
    lines = [f"FAILED {e['task']}: {e['error']}" for e in doc["errors"]]
    lines += [f"skipped (budget): {label}" for label in doc["skipped"]]
    lines += [f"note: {r['optimizer']} {r['workload']} {r['candidate']}: {r['error']}" for r in doc["results"] if r["error"]]
    return lines


def format_report(doc: dict[str, Any]) -> str:
    """Every section of ``doc`` as markdown tables, then failures and the targets."""
    parts = [[_header(doc)], speed_table(doc), memory_table(doc), graph_table(doc), instances_table(doc), host_table(doc),
             lowbit_table(doc), nonepattern_table(doc), construction_table(doc), loops_table(doc), eager_loops_table(doc),
             _failures(doc), not_measured_lines(doc), targets_table(doc)]
    return "\n\n".join("\n".join(p) for p in parts if p)


def format_summary(doc: dict[str, Any]) -> str:
    """One line per speed measurement (dml_optim ``auto`` beside torch fused and the best torch.optim),
    and the targets' counts."""
    rows = []
    for ref in doc["references"]:
        mine = speed_row(doc, ref["optimizer"], ref["workload"], f"dml_optim {ref['auto_backend']}")
        fused = speed_row(doc, ref["optimizer"], ref["workload"], "torch fused")
        if mine is None or mine["ms_per_step"] is None:
            continue
        rows.append([ref["optimizer"], ref["workload"], f"{mine['ms_per_step']:.3f} ({auto_label(ref)})",
                     _f(None if fused is None else fused["ms_per_step"], ".3f"), ratio_cell(*versus(doc, mine, "torch fused")),
                     _f(mine["ratio_to_best_torch"], ".2f", "x"), _pct(mine["fraction_of_reference"]),
                     _f(mine["ops_per_step"], "d")])
    counts = {s: sum(t["status"] == s for t in doc["targets"]) for s in ("PASS", "MISS", "not measured")}
    lines = ["summary: " + _header(doc)]
    if rows:
        lines += _table(["optimizer", "workload", "dml_optim ms (auto)", "torch fused ms", "vs fused", "vs best torch",
                         f"% of {reference_name(doc)}", "ops/step"], rows, 2)
    lines.append(f"targets: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['not measured']} not measured; "
                 f"{len(doc['errors'])} failed, {len(doc['skipped'])} skipped")
    return "\n".join(lines)


def default_output_path(device: str, root: Path = DEFAULT_OUTPUT_DIR, *, quick: bool = False) -> Path:
    """``<root>/bench/<device>-<UTC date>.json`` (``...-quick.json`` for ``--quick``).

    ``root`` defaults to :data:`dml_optim.console.DEFAULT_OUTPUT_DIR`
    (``dml-optim-out``, relative to the working directory).  The repository's
    recorded results live in ``bench/results/`` and are written there only
    with an explicit ``--out``.
    """
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    suffix = "-quick" if quick else ""
    return Path(root) / "bench" / f"{device.split(':')[0]}-{date}{suffix}.json"


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write ``doc`` as indented JSON (to a temporary file, then renamed), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
