"""The generated tables of the README and the documentation site are what ``tools/readme_tables.py`` writes from
the committed results; a table the two share is the same text in both."""

from __future__ import annotations

import copy
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import readme_tables  # noqa: E402

from dml_optim.benchmark import record_targets  # noqa: E402
from dml_optim.benchmark.timing import reference_name  # noqa: E402
from dml_optim.benchmark.lowbit import CANDIDATES  # noqa: E402
from dml_optim.benchmark.targets import reference, speed_row  # noqa: E402
from test_bench_smoke import construction_record, host_row, nonepattern_record  # noqa: E402


def test_readme_holds_what_the_script_writes():
    """README.md and docs/ hold what the script writes; the measured tables (tests/test_memory_table.py measures
    them) are checked for being the same in every file that holds them."""
    out = io.StringIO()
    with redirect_stdout(out):
        status = readme_tables.main(["--check", "--skip-measured"])
    assert status == 0, "a file differs from `python tools/readme_tables.py`:\n" + out.getvalue()[-3000:]


def test_every_table_is_placed_and_the_readme_holds_the_headline_ones():
    placed = {name: [p.relative_to(ROOT).as_posix() for p in readme_tables.files()
                     if f"<!-- {name} -->" in p.read_text(encoding="utf-8")] for name in readme_tables.TABLES}
    assert all(placed.values()), placed
    # one short table each for DirectML ops, speed, memory and precision in the README, each also on the site
    for name in ("AUDIT-TABLE", "SPEED-TABLE", "TRAINING-BYTES", "PRECISION-TABLE"):
        assert placed[name][0] == "README.md" and len(placed[name]) >= 2, (name, placed[name])
    for name in ("BENCH-TABLE", "LOWBIT-TABLE", "MEMORY-TABLE"):  # the long ones: the site only
        assert "README.md" not in placed[name], name
    assert readme_tables.MEASURED <= set(readme_tables.TABLES)


def test_a_measured_table_that_differs_between_files_is_reported(tmp_path, monkeypatch):
    readme, page = tmp_path / "README.md", tmp_path / "page.md"
    readme.write_text("<!-- TRAINING-BYTES -->\nmeasured\n<!-- /TRAINING-BYTES -->\n", encoding="utf-8")
    page.write_text("<!-- TRAINING-BYTES -->\nstale\n<!-- /TRAINING-BYTES -->\n", encoding="utf-8")
    monkeypatch.setattr(readme_tables, "files", lambda: [readme, page])
    monkeypatch.setattr(readme_tables, "ROOT", tmp_path)
    monkeypatch.setattr(readme_tables, "TABLES", {"TRAINING-BYTES": lambda: pytest.fail("measured")})
    out = io.StringIO()
    with redirect_stdout(out):
        assert readme_tables.main(["--check", "--skip-measured"]) == 1
    assert "-stale" in out.getvalue() and "+measured" in out.getvalue()
    readme_tables.main(["--skip-measured"])
    assert page.read_text(encoding="utf-8") == readme.read_text(encoding="utf-8")


def test_every_source_is_committed_and_complete():
    for key, path in readme_tables.SOURCES.items():
        doc = json.loads((ROOT / path).read_text())
        if key == "audit":
            assert [(r["optimizer"], r["model"]) for r in doc["rows"]] == list(readme_tables.AUDIT_ROWS)
        elif key == "memory":  # the whole-training peaks: every row measured or saying why not, torch's reference in both styles
            assert doc["schema"] == "dml-optim-wholemem-1" and doc["model"]["params"] >= 50_000_000, path
            assert all(r["status"] == "measured" or r["reason"] for r in doc["rows"]), path
            assert {r["zero_grad"] for r in doc["rows"] if r["config"] == "torch-fp32" and r["status"] == "measured"} == {
                "set_to_none=True", "set_to_none=False"}, path
        elif key == "fits":  # the deepest GPT in the budget: each row's depth measured to fit, the next not to
            assert doc["schema"] == "dml-optim-fits/1" and doc["rows"][0]["config"] == "torch-fp32", path
            for r in doc["rows"]:
                assert r["depth"] >= 1 and r["peak_bytes"] <= doc["budget_bytes"] < r["next_peak_bytes"], (path, r)
                assert str(r["depth"]) in r["measured"] and str(r["depth"] + 1) in r["measured"], (path, r)
        else:
            device = "cpu" if key == "lowbit" else key  # the low-bit row is a CPU run of its own
            assert doc["complete"] and not doc["quick"] and doc["device"].startswith(device), path
            assert doc["errors"] == [] and doc["skipped"] == [], path
    lowbit = readme_tables._load("lowbit")["lowbit"]
    recorded = [r["candidate"] for r in lowbit[0]["rows"]]
    # every recorded candidate is one the row still runs, in its order; the per-codebook candidates
    # ("dml_optim 8-bit blockwise-1/-2") came after the committed run, which predates the second codebook
    assert recorded == [c for c in CANDIDATES if c in recorded] and {"torch fused", "dml_optim 8-bit", "dml_optim 4-bit",
                                                                    "bitsandbytes AdamW8bit"} <= set(recorded)
    assert all(r["available"] and r["ms_per_step"] for r in lowbit[0]["rows"])  # the peers were installed


def test_the_published_runs_hold_the_rows_of_the_issues():
    """Issue 13 and the frozen-parameter issue: the rows the README shows were all measured, side by side."""
    cpu, cuda = readme_tables._load("cpu"), readme_tables._load("cuda")
    for doc in (cpu, cuda):
        works = {w["name"] for w in doc["workloads"]}
        assert any(w.startswith("lora-") for w in works) and sum(w.startswith("unfreeze-") for w in works) == 3
        measured = {(r["optimizer"], r["candidate"]) for r in doc["results"] if r["ms_per_step"] is not None}
        assert {("adamw", "dml_optim eager"), ("adamw", "torch foreach"), ("adamw", "torch fused")} <= measured
        assert {m["pack_via"] for m in doc["memory"]} == {"auto", "device", "host"}
        assert len(doc["instances"]) == 1
    # the CPU run: host work with both checks modes; the CUDA-only parts listed with the reason
    assert [h["optimizer"] for h in cpu["host_work"]] == list(readme_tables._OPTIMIZERS)
    assert all(h["ratio_full"] > 0 and h["ratio_fast"] > 0 for h in cpu["host_work"])
    left_out = {n["what"]: n["reason"] for n in cpu["not_measured"]}
    assert {"graph", "kernel time", "copy bandwidth"} <= set(left_out)
    assert all(left_out[w].startswith("CUDA only: ") for w in ("graph", "kernel time", "copy bandwidth"))
    # the CUDA run: kernel time and the copy reference beside wall time, many-small replayed in a graph
    assert all(r["kernel_ms"] is not None for r in cuda["results"] if r["ms_per_step"] is not None)
    assert {r["reference"] for r in cuda["references"]} == {"copy"}
    (graph,) = cuda["graphs"]
    assert graph["workload"] == "many-small" and {(r["candidate"], r["mode"]) for r in graph["rows"] if r["available"]} == {
        (c, m) for c in ("dml_optim eager", "dml_optim compiled", "torch foreach", "torch fused") for m in ("graph", "steps")}


def test_a_changed_number_changes_the_tables():
    sections = readme_tables.sections(skip_measured=True)
    audit = readme_tables._load("audit")
    changed = copy.deepcopy(audit)
    changed["rows"][0]["torch"]["total_ops"] += 1
    assert readme_tables.audit_table(changed, "x.json") != readme_tables.audit_table(audit, "x.json")
    cpu, cuda = readme_tables._load("cpu"), readme_tables._load("cuda")
    for doc in (cpu, cuda):  # the step time of what backend="auto" runs, on resnet50, is in the table
        slower = copy.deepcopy(doc)
        auto = reference(slower, "adam", "resnet50")["auto_backend"]
        speed_row(slower, "adam", "resnet50", f"dml_optim {auto}")["ms_per_step"] *= 2
        changed = readme_tables.bench_section(slower, cuda) if doc is cpu else readme_tables.bench_section(cpu, slower)
        assert changed != sections["BENCH-TABLE"]
    slower = copy.deepcopy(cpu)
    slower["host_work"][0]["ratio_full"] *= 2
    assert readme_tables.bench_section(slower, cuda) != sections["BENCH-TABLE"]


def test_the_audit_document_has_the_audit_commands_fields(capsys):
    """The recorded rows are `dml-optim audit --json` outputs: the same keys as the command prints today."""
    from dml_optim.cli import main

    assert main(["audit", "--optimizer", "momentum", "--model", "tiny-mlp", "--json"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    (recorded, *_) = readme_tables._load("audit")["rows"]
    assert set(recorded) == set(fresh) and set(recorded["ours"]) == set(fresh["ours"])


def test_render_replaces_only_between_the_markers_and_names_a_missing_one():
    text = "a\n<!-- X -->\nold\n<!-- /X -->\nb\n"
    assert readme_tables.render(text, {"X": "new"}) == "a\n<!-- X -->\nnew\n<!-- /X -->\nb\n"
    with pytest.raises(ValueError, match="<!-- Y -->"):
        readme_tables.render(text, {"Y": "new"})
    # a file gets the tables whose markers it holds, and only those
    contents = {"AUDIT-TABLE": "audit", "SPEED-TABLE": "speed"}
    page = "<!-- SPEED-TABLE -->\nold\n<!-- /SPEED-TABLE -->\n"
    assert readme_tables.render_file(page, contents) == "<!-- SPEED-TABLE -->\nspeed\n<!-- /SPEED-TABLE -->\n"


def test_the_headline_tables_follow_their_sources():
    cpu, cuda = readme_tables._load("cpu"), readme_tables._load("cuda")
    table = readme_tables.speed_headline(cpu, cuda)
    for work, optimizer in readme_tables._HEADLINE_SPEED:  # each row: ours and torch fused, as the full table has
        auto = reference(cpu, optimizer, work)["auto_backend"]
        ms = readme_tables._ms(speed_row(cpu, optimizer, work, f"dml_optim {auto}"))
        assert any(x.startswith(f"| {work} | {optimizer} | {ms} / ") for x in table.splitlines()), (work, optimizer)
    slower = copy.deepcopy(cpu)
    speed_row(slower, "adam", "resnet50", f"dml_optim {reference(cpu, 'adam', 'resnet50')['auto_backend']}")["ms_per_step"] *= 2
    assert readme_tables.speed_headline(slower, cuda) != table
    report_text = (ROOT / readme_tables.COMPARE_REPORT).read_text(encoding="utf-8")
    precision = readme_tables.precision_headline(report_text, readme_tables.COMPARE_REPORT)
    assert "| `fp16-kahan` | yes | 0.000209 | 6.92% | 0.625 |" in precision.splitlines()
    row = next(x for x in report_text.splitlines() if x.startswith("| fp16-kahan | recorded |"))
    changed = report_text.replace(row, row.replace("| 0.000209 |", "| 0.5 |"))
    assert "| `fp16-kahan` | yes | 0.5 | 6.92% | 0.625 |" in readme_tables.precision_headline(changed, "x").splitlines()


def _older(doc: dict) -> dict:
    """``doc`` as a run before 2026-11-25 wrote it: no targets beside the rows, no None-pattern,
    construction or loop records (the committed CUDA document is one)."""
    doc = copy.deepcopy(doc)
    for key in ("nonepattern", "construction", "loops", "loops_eager"):
        doc.pop(key, None)
    for ref in doc["references"]:
        ref.pop("targets", None)
    for t in doc["targets"]:
        for key in ("row", "optimizer", "workload", "versus", "reason"):
            t.pop(key, None)
    doc["targets"] = [t for t in doc["targets"] if "None gradients" not in t["target"]
                      and "construction + first step" not in t["target"] and not t["target"].startswith(("loop ", "eager "))]
    return doc


def test_a_document_without_row_targets_shows_what_it_has():
    """Documents that predate the targets beside each row and the None-pattern and construction rows:
    no targets column, no such tables, every target in the one targets table."""
    cpu, cuda = _older(readme_tables._load("cpu")), readme_tables._load("cuda")
    section = readme_tables.bench_section(cpu, cuda)
    assert "| targets |" not in section and "None gradients" not in section and "construction + first step" not in section
    assert "| loop model |" not in section and "DirectML's path" not in section
    for doc in (cpu, cuda):
        assert all(f"| {t['target']} |" in section for t in doc["targets"])


def _newer(doc: dict) -> dict:
    """``doc`` as a run of today writes it: None-pattern and construction records, targets checked and stored
    beside their rows."""
    doc = copy.deepcopy(doc)
    ours = "dml_optim auto"
    doc["nonepattern"] = [nonepattern_record("adamw", {(ours, "changing"): 3.0, (ours, "steady"): 1.0,
                                                       ("torch fused", "changing"): 4.0}),
                          nonepattern_record("momentum", {("torch fused", "changing"): None})]
    doc["construction"] = [construction_record("adamw", ours=3.0, fused=2.5)]
    record_targets(doc)
    return doc


def test_a_document_with_row_targets_shows_each_beside_its_row():
    cpu, cuda = _newer(readme_tables._load("cpu")), readme_tables._load("cuda")
    section = readme_tables.bench_section(cpu, cuda)
    cpu_part, cuda_part = section.split("Measured on an NVIDIA")
    lines = cpu_part.splitlines()

    def line(*cells: str) -> str:
        (found,) = [x for x in lines if x.startswith("| " + " | ".join(cells) + " |")]
        return found

    # speed and frozen rows: their targets in the last column, PASS / MISS / not measured (what is missing),
    # as the document's target records say
    def statuses(work: str, optimizer: str) -> list[str]:
        return [t["status"] for t in cpu["targets"]
                if t.get("row") in ("speed", "frozen") and (t.get("workload"), t.get("optimizer")) == (work, optimizer)]

    for work, optimizer, shown in (("resnet50", "adam", ">= 1.1x torch fused"),
                                   ("many-small", "adam", ">= 3.0x torch foreach"),
                                   ("one-64m", "momentum", f"of {reference_name(cpu)}"),
                                   ("unfreeze-4of16x512", "momentum", ">= 1.0x torch fused")):
        row = next(x for x in lines if x.startswith(f"| {work}") and f"| {optimizer} |" in x)
        last = row.split("|")[-2]
        assert shown in last, row
        found = [s for part in last.split(";") for s in ("PASS", "MISS", "not measured") if f": {s}" in part]
        assert found == statuses(work, optimizer), (row, statuses(work, optimizer))
    assert "(torch fused n/a)" in next(x for x in lines if x.startswith("| unfreeze-4of16x512") and "| momentum |" in x)
    # the new rows' tables, with their targets
    assert line("adamw", "3.00 (3.00-3.00)", "1.00 (1.00-1.00)", "3.00x").endswith(
        "| <= 1.5x the steady step: MISS; >= 1.0x torch fused: PASS |")
    assert line("momentum", "1.00 (1.00-1.00)", "1.00 (1.00-1.00)", "1.00x").endswith(
        "| <= 1.5x the steady step: PASS; >= 1.0x torch fused: not measured (torch fused (changing) n/a) |")
    assert line("linear-16x512", "adamw", "compiled: 3.00 (3.00-3.00)", "2.50 (2.50-2.50)", "1.20x").endswith(
        "| <= 1.5x torch fused: PASS |")
    # the loops people run: each CPU loop row and each eager ratio with its target beside it
    for rec in cpu["loops"]:
        (t,) = rec["targets"]
        assert any(x.startswith(f"| {rec['model']} | {rec['loop']} |") and x.endswith(f"| >= 1.0x torch fused: {t['status']} |")
                   for x in lines), (rec["model"], rec["loop"])
    labels = {"eager steady step, 1 tensor:": "| 1 tensor / torch's for-loop AdamW, 1 tensor |",
              "eager step with a new lr:": "| lr changing / steady, 1 tensor |",
              "eager steady step, 2000 tensors:": "| 2000 tensors / 1 tensor (default checks) |"}
    for t in cpu["loops_eager"][0]["targets"]:
        (label,) = [v for k, v in labels.items() if t["target"].startswith(k)]
        assert any(x.startswith(label) and x.endswith(f"| {t['target'].split(': ', 1)[1]}: {t['status']} |")
                   for x in lines), t["target"]
    # the targets table lists the others, once; the counts cover all
    counts = {s: sum(t["status"] == s for t in cpu["targets"]) for s in ("PASS", "MISS", "not measured")}
    assert f"Targets: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['not measured']} not measured in all." in cpu_part
    for t in cpu["targets"]:
        assert (f"| {t['target']} |" in cpu_part) is (t.get("row") is None), t["target"]
    # the CUDA document, older, keeps its single targets table
    assert all(f"| {t['target']} |" in cuda_part for t in cuda["targets"])


def _fused(doc: dict) -> dict:
    """``doc`` as a CPU run with the fused backend writes it: a ``dml_optim fused`` row beside the others (here the
    row ``auto`` ran before, a little faster), ``auto_backend`` ``fused`` and ``auto_runs`` in the reference
    records, host rows with ``checks="refs"`` (the default in 2026-11) beside full and fast and the eager chain, the None-pattern and
    construction records saying what auto ran; the targets checked again."""
    doc = _newer(doc)
    doc["candidates"] = ["dml_optim eager", "dml_optim compiled", "dml_optim fused", *doc["candidates"][2:]]
    for ref in doc["references"]:
        if ref["auto_backend"] == "auto":
            ref["auto_runs"] = "fused"
            continue
        row = copy.deepcopy(speed_row(doc, ref["optimizer"], ref["workload"], f"dml_optim {ref['auto_backend']}"))
        row.update(candidate="dml_optim fused", ms_per_step=row["ms_per_step"] * 0.9)
        doc["results"].append(row)
        ref["auto_backend"] = ref["auto_runs"] = "fused"
    doc["host_work"] = [host_row(o, refs=12.0, full=80.0, fast=13.0, checks="refs") for o in readme_tables._OPTIMIZERS]
    for rec in doc["nonepattern"]:
        rec["auto_runs"] = "fused"
    for rec in doc["construction"]:
        rec["auto_backend"] = rec["rows"][0]["backend"] = "fused"
    record_targets(doc)
    return doc


def test_a_document_with_the_fused_backend_says_what_auto_ran():
    """A CPU run where ``auto`` runs torch's fused kernel: every label that names auto's backend says ``fused``,
    the speed rows compare the fused row, the host table has the checks modes and the eager chain, and the one
    host target per optimizer is the default's (checks="refs")."""
    old = readme_tables._load("cpu")
    cpu, cuda = _fused(old), readme_tables._load("cuda")
    cpu_part = readme_tables.bench_section(cpu, cuda).split("Measured on an NVIDIA")[0]
    lines = cpu_part.splitlines()
    fused = speed_row(cpu, "adam", "resnet50", "dml_optim fused")["ms_per_step"]
    (resnet50,) = [x for x in lines if x.startswith("| resnet50 | adam |")]
    assert resnet50.startswith(f"| resnet50 | adam | {readme_tables._ms({'ms_per_step': fused})} (fused) |"), resnet50
    assert ">= 1.1x torch fused:" in resnet50
    frozen = [x for x in lines if x.startswith(("| lora-", "| unfreeze-"))]
    assert frozen and all(" (fused) |" in x and " (auto) |" not in x for x in frozen)
    assert any(x.startswith("| adamw | fused: 3.00 (3.00-3.00) |") for x in lines)  # None patterns
    assert any(x.startswith("| linear-16x512 | adamw | fused: 3.00 (3.00-3.00) |") for x in lines)  # construction
    # the host table: the default backend with each checks mode, the eager chain beside it
    assert "| host work (cpu, 1 thread) | backend (auto) | 2000x16 us: checks=refs (default) / full / fast |" in cpu_part
    assert "| adam | fused | 12 / 80 / 13 | 10 | 1.20x | 8.00x | 1.30x | 20 / 15 | 1.33x | 2 / 2, 8 / 8 |" in lines
    assert '`"refs"` (the default, the target\'s' in " ".join(lines)
    host = [t for t in cpu["targets"] if t["target"].startswith("host work")]
    assert [(t["target"], t["dml_backend"], t["status"]) for t in host] == [
        (f"host work, {name}: 2000x16 <= 3x 1x32000 (checks=refs, the default)", "fused", "PASS")
        for name in ("Adam", "AdamW", "Adagrad", "Momentum")]
    assert all(f"| {t['target']} | fused | 1.20x | PASS |" in lines for t in host) and "(checks=full)" not in cpu_part
    # what auto runs, said once after both runs
    assert "On the CPU `auto` runs torch's own fused kernel" in " ".join(readme_tables.bench_section(cpu, cuda).split())
    # every speed and frozen target compares what auto ran: the fused row, or the frozen rows' own auto candidate
    assert {t["dml_backend"] for t in cpu["targets"] if t.get("row") in ("speed", "frozen", "nonepattern",
                                                                          "construction")} == {"fused"}
    # the document as recorded before renders as it did (the README holds it)
    assert readme_tables.bench_section(old, cuda) == readme_tables.sections(skip_measured=True)["BENCH-TABLE"]


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``text``, as cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| configuration") and set(line) - set("|-: ")]


def test_every_configuration_row_says_whether_it_runs_on_directml():
    """Issue 49: DirectML has no bfloat16. Every row of the memory, 2 GB and precision tables that names a
    configuration says whether it runs on DirectML: the bf16 rows that they do not, the float16 lean rows that
    they are DirectML's recommended configuration; the 2 GB table's lean rows are float16."""
    from dml_optim.benchmark.wholemem import LEAN_FP16, NOT_ON_DIRECTML, RECOMMENDED, config

    sections = readme_tables.sections(skip_measured=True)
    peak = _table_rows(sections["PEAK-TABLE"])
    assert peak and all(len(r) == 5 and r[1] for r in peak)
    by_label = {r[0]: r[1] for r in peak}
    for key in LEAN_FP16:
        assert by_label[config(key).label] == f"**{RECOMMENDED}**", key
    bf16 = [r for r in peak if "bf16" in r[0]]
    assert len(bf16) >= 5 and all(r[1] == NOT_ON_DIRECTML for r in bf16)
    assert all(r[1] != NOT_ON_DIRECTML for r in peak if "bf16" not in r[0])
    fits = sections["FITS-TABLE"]
    measured, extrapolated = fits.split("(Extrapolated, not measured", 1)[0], fits
    fit_rows = [r for r in _table_rows(measured) if r[0].startswith(("torch", "dml_optim"))]
    assert [r[0] for r in fit_rows[:3]] == [config(k).label for k in ("torch-fp32", *LEAN_FP16)]
    assert all("fp16" in r[0] and r[1] == f"**{RECOMMENDED}**" for r in fit_rows[1:3])
    assert "| configuration (extrapolated, not measured) | 8 GB | 12 GB | 24 GB |" in extrapolated
    assert "Extrapolated, not measured" in extrapolated and "floor((budget - a) / b)" in extrapolated
    assert "DirectML's lean configuration, 8-bit state" in extrapolated and "through the measured depths" in extrapolated
    precision = _table_rows(sections["PRECISION-TABLE"])
    assert all(r[1] == NOT_ON_DIRECTML for r in precision if r[0].startswith("`bf16"))
    assert [r[1] for r in precision if r[0] == "`fp16-sr-8bit`"] == [f"**{RECOMMENDED}**"]
    assert all(r[1] == "yes" for r in precision if not r[0].startswith(("`bf16", "`fp16-sr-8bit")))


def test_the_memory_and_fits_sources_measured_the_float16_lean_rows():
    from dml_optim.benchmark.wholemem import LEAN_FP16, REFERENCE

    memory, fits = readme_tables._load("memory"), readme_tables._load("fits")
    measured = {r["config"] for r in memory["rows"] if r["status"] == "measured" and not r.get("carried_from")}
    assert {REFERENCE, *LEAN_FP16, "ours-bf16-sr-8bit-eager-backward", "ours-bf16-sr-4bit-eager-backward"} <= measured
    assert [r["config"] for r in fits["rows"]] == [REFERENCE, *LEAN_FP16]
    assert [e["config"] for e in fits["extrapolated"]["rows"]] == [REFERENCE, *LEAN_FP16]
