"""Smoke test of the benchmark (``dml-optim bench --quick`` / ``bench/run.py --quick``).

Checks the shape of what it writes and prints, where it writes it, its
header and progress, its usage errors, that a failing measurement is recorded
while the run goes on, and what the measurements must show whatever the
machine's speed (op counts, state bytes, compiled graphs); never a time.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dml_optim import benchmark, compiled
from dml_optim.benchmark.run import Task, not_measured
from dml_optim.benchmark.speed import ROW_FIELDS
from dml_optim.benchmark.workloads import lora, unfreezing
from dml_optim.cli import main
from dml_optim.opcount import count_ops
from dml_optim.optimizers.registry import get

ROOT = Path(__file__).resolve().parent.parent
NUMERIC = ("ms_per_step", "steps_per_s", "ratio_to_best_torch", "gbs", "fraction_of_reference", "first_step_ms")


@pytest.mark.slow
def test_quick_benchmark_measures_every_row(tmp_path, monkeypatch, capsys):
    # from a folder that is not the checkout, without --out: the result goes to
    # ./dml-optim-out/bench/, and no bench/results/ appears there
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick"]) == 0
    (out,) = (tmp_path / "dml-optim-out" / "bench").glob("cpu-*-quick.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dml-optim-out"]
    doc = json.loads(out.read_text())
    lines = capsys.readouterr().out.splitlines()
    rows = benchmark.default_rows("cpu")
    assert lines[0].startswith(f"dml-optim bench --quick: device cpu, rows {', '.join(rows)}, optimizers adam, adamw, "
                               "adagrad, momentum, workloads many-small-256; ")
    assert lines[0].endswith("results to dml-optim-out/bench/" + out.name)
    progress = [line for line in lines if line.startswith("bench: measurement ")]
    assert len(progress) == int(lines[0].split("; ")[1].split()[0]) and progress[-1].startswith("bench: measurement ")
    assert lines.index(progress[-1]) < lines.index(next(line for line in lines if line.startswith("| optimizer |")))
    assert lines[-1] == f"wrote {out.relative_to(tmp_path)}" and any(line.startswith("summary: ") for line in lines)

    assert doc["schema"] == 2 and doc["quick"] is True and doc["complete"] is True and doc["device"] == "cpu"
    assert doc["rows"] == list(rows) and doc["errors"] == [] and doc["skipped"] == []
    assert doc["candidates"] == list(benchmark.CANDIDATES)
    works = {w["name"]: w for w in doc["workloads"]}
    assert set(works) == {"many-small-256", lora(d=64).name, *(unfreezing(k, d=64).name for k in (1, 4, 16))}
    expected = {(o, w, c) for o in benchmark.OPTIMIZERS for w in works for c in benchmark.CANDIDATES}
    assert {(r["optimizer"], r["workload"], r["candidate"]) for r in doc["results"]} == expected
    assert len(doc["results"]) == len(expected)

    compile_ok = compiled.compile_available("cpu")[0]
    for r in doc["results"]:
        assert set(r) == set(ROW_FIELDS), r["candidate"]
        if r["candidate"].startswith("dml_optim"):
            assert r["available"] or (r["candidate"].endswith("compiled") and not compile_ok), r
        if not r["available"]:
            assert isinstance(r["reason"], str) and r["reason"], r  # n/a says why
            continue
        for f in NUMERIC:
            assert isinstance(r[f], float) and math.isfinite(r[f]) and r[f] > 0, (r["candidate"], f, r[f])
        assert r["samples"] >= doc["settings"]["min_rounds"] and r["kernel_ms"] is None  # no kernel time on the CPU
        assert (r["compile_s"] is not None) == (r["candidate"] == "dml_optim compiled")
    assert len(doc["references"]) == len(benchmark.OPTIMIZERS) * len(works)

    def row(o, w, c):
        return next(r for r in doc["results"] if (r["optimizer"], r["workload"], r["candidate"]) == (o, w, c))

    shapes = {w.name: w for w in (benchmark.workload("many-small-256"), lora(d=64), *(unfreezing(k, d=64) for k in (1, 4, 16)))}
    for o in benchmark.OPTIMIZERS:
        states = len(get(o).state_names)
        for w, info in works.items():
            # torch's for-loop dispatches ops per trainable tensor; dml_optim's eager chain a few per step class
            trainable = sum(shapes[w].is_trainable(i) for i in range(info["tensors"]))
            assert row(o, w, "torch for-loop")["ops_per_step"] >= trainable, (o, w)
            assert row(o, w, "dml_optim eager")["ops_per_step"] <= 12 * 3, (o, w)  # at most 3 step classes here
            # states (and eager's one full-size scratch) for the trainable elements only: frozen ones hold nothing
            assert row(o, w, "dml_optim eager")["optimizer_bytes"] == (states + 1) * 4 * info["trainable_elements"], (o, w)
            if compile_ok:
                assert row(o, w, "dml_optim compiled")["optimizer_bytes"] == states * 4 * info["trainable_elements"], (o, w)
        # one flat buffer, one step class: the same ops for 256 tensors as for the LoRA model's 32 trainable ones
        assert (row(o, "many-small-256", "dml_optim eager")["ops_per_step"]
                == row(o, lora(d=64).name, "dml_optim eager")["ops_per_step"])

    assert [h["optimizer"] for h in doc["host_work"]] == list(benchmark.OPTIMIZERS)
    for h in doc["host_work"]:  # one flat buffer: 2,000 tensors dispatch the ops of one; the rest is host work
        assert h["ops_many_full"] == h["ops_many_fast"] == h["ops_one"] <= 12, h
    assert [m["pack_via"] for m in doc["memory"]] == ["auto", "device", "host"]
    resnet50 = benchmark.workload("resnet50").trainable_numel
    assert all(m["peak_ratio"] > 0 and m["trainable_bytes"] == 4 * resnet50 for m in doc["memory"])
    # resnet50's largest tensors are layer4's 3x3 convolutions (512 x 512 x 3 x 3, above fc's 1000 x 2048):
    # 9% of the model, so the CPU bound (1 + 0.09 + 0.05) stays under the 1.25 target
    assert all(m["largest_share"] == 512 * 512 * 9 / resnet50 and m["limit"] == 1.25 for m in doc["memory"])
    if compile_ok:
        (inst,) = doc["instances"]
        assert len(inst["first_step_ms"]) == 12 and inst["ms_2nd"] > 0 and inst["ms_12th"] > 0
        assert inst["graphs_compiled"] <= 1  # one graph serves every instance and epsilon
    # the CUDA-only parts are listed with the reason, and the printed report says so
    left_out = {n["what"]: n["reason"] for n in doc["not_measured"]}
    assert set(left_out) == {"graph", "kernel time", "copy bandwidth"}
    assert all(reason.startswith("CUDA only: ") for reason in left_out.values())
    assert f"not measured: graph: {left_out['graph']}" in lines
    statuses = {t["target"]: t["status"] for t in doc["targets"]}
    assert set(statuses.values()) <= {"PASS", "MISS", "not measured"}
    assert all(statuses[t] != "not measured" for t in statuses if t.startswith(("host work", "12th", "resnet50 construction")))
    assert not any("CUDA graph" in t or "copy bandwidth" in t for t in statuses)


def test_a_failing_measurement_is_recorded_and_the_run_goes_on(tmp_path):
    plan = benchmark.make_plan(quick=True, rows=["host"], optimizers=["momentum"])
    (real,) = plan.tasks

    def broken(doc, log):
        raise RuntimeError("CUDA out of memory\nsecond line")

    plan.tasks = [Task("speed", "a broken row", broken), real]
    written = []
    doc = benchmark.run_plan(plan, log=lambda message: None, checkpoint=lambda d: written.append(json.dumps(d)))
    assert doc["errors"] == [{"row": "speed", "task": "a broken row", "error": "RuntimeError: CUDA out of memory"}]
    assert [h["optimizer"] for h in doc["host_work"]] == ["momentum"] and doc["complete"]
    (h,) = doc["host_work"]
    assert h["ops_many_full"] == h["ops_many_fast"] == h["ops_one"] == _momentum_ops()
    host_targets = [t for t in doc["targets"] if t["target"].startswith("host work")]
    assert [t["target"].rsplit("(", 1)[1] for t in host_targets] == ["checks=full)", "checks=fast)"]
    assert all(t["status"] in ("PASS", "MISS") and t["measured"] == h[f"ratio_{t['target'][-5:-1]}"] for t in host_targets)
    assert len(written) == 3 and json.loads(written[0])["complete"] is False  # after each task, then at the end


def _momentum_ops() -> int:
    """Ops of one eager Momentum step over one flat buffer (what the host row's steps must dispatch)."""
    import dml_optim

    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(16)
    opt = dml_optim.Momentum(params, lr=0.01, backend="eager")
    opt.step()
    return count_ops(opt.step)


def test_what_a_run_leaves_out_is_listed_with_the_reason():
    plan = benchmark.make_plan(quick=True, rows=["graph", "host"], optimizers=["momentum"])
    assert plan.rows == ("host",) and [t.row for t in plan.tasks] == ["host"]  # graph: not an error, left out
    reasons = {n["what"]: n["reason"] for n in plan.not_measured}
    assert reasons.pop("graph").startswith("CUDA only: ")
    assert set(reasons) == {"memory", "instances", "frozen", "lowbit", "speed"}
    assert compiled.compile_available("cpu")[0] is (reasons["instances"] == "not selected (--rows)")
    assert {reasons[r] for r in ("memory", "frozen", "lowbit", "speed")} == {"not selected (--rows)"}
    cuda = {n["what"]: n["reason"] for n in not_measured(torch.device("cuda"), benchmark.default_rows("cuda"))}
    assert "measured by a CPU run" in cuda["host"]
    assert not {"graph", "kernel time", "copy bandwidth"} & set(cuda)


def test_a_spent_budget_skips_the_remaining_measurements():
    plan = benchmark.make_plan(quick=True, rows=["host", "speed"], optimizers=["momentum"], budget_s=1e-9)
    doc = benchmark.run_plan(plan, log=lambda message: None)
    assert doc["skipped"] == [t.label for t in plan.tasks] and doc["results"] == [] and doc["complete"]
    assert "skipped (budget): speed: momentum on many-small-256" in benchmark.format_report(doc)


def test_op_counts_reflect_the_implementation():
    """Eager Adam is a handful of ops over one buffer; torch's for-loop is ~10 per tensor."""
    import dml_optim

    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(20)]
    for p in params:
        p.grad = torch.randn(8)
    ours = dml_optim.Adam(params, backend="eager")
    n_ours = count_ops(ours.step)
    theirs_params = [torch.nn.Parameter(torch.randn(8)) for _ in range(20)]
    for p in theirs_params:
        p.grad = torch.randn(8)
    theirs = torch.optim.Adam(theirs_params, foreach=False)
    theirs.step()
    n_theirs = count_ops(theirs.step)
    assert 3 <= n_ours <= 12  # independent of the number of tensors
    assert n_theirs >= 5 * len(params)


@pytest.mark.parametrize("argv,words", [
    (["--workloads", "no-such-model"], ["--workloads", "no-such-model", "resnet50"]),
    (["--budget", "0"], ["--budget", "positive", "0"]),
])
def test_bench_usage_errors_are_one_line(argv, words, capsys):
    assert main(["bench", "--quick", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert all(w in line for w in words), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is NOT usable")
def test_bench_on_an_unusable_device_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--quick", "--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dml-optim bench: error: --device: device 'cuda' is not usable: ")
    assert not (tmp_path / "x.json").exists()


def test_workloads_are_the_models_of_every_command():
    from dml_optim.inventory import models_dir

    assert benchmark.workload("tiny-mlp") == benchmark.workload(str(models_dir() / "tiny-mlp.json"))
    assert len(benchmark.workload("many-small").shapes) == 2000
    assert benchmark.workload("one-64m").shapes == ((2**26,),)


def test_frozen_workloads_are_model_parameters():
    model = lora()
    assert len(model.shapes) == 16 * 4 and sum(model.trainable) == 32  # base weight and bias frozen; down, up trainable
    assert model.trainable_numel == 16 * 2 * 512 * 8 and model.numel == model.trainable_numel + 16 * (512 * 512 + 512)
    assert sum(unfreezing(4).trainable) == 8 and unfreezing(4).trainable[-8:] == (True,) * 8
    with pytest.raises(ValueError, match="k must be in"):
        unfreezing(0)


def test_bench_script_runs_from_a_checkout():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--rows" in proc.stdout and "--budget" in proc.stdout and "examples:" in proc.stdout


def test_quick_results_do_not_overwrite_full_ones(tmp_path):
    full = benchmark.default_output_path("cuda:0", tmp_path)
    quick = benchmark.default_output_path("cuda:0", tmp_path, quick=True)
    assert full.parent == quick.parent == tmp_path / "bench"
    assert full.name.startswith("cuda-") and full.suffix == ".json"
    assert quick.name == full.name.replace(".json", "-quick.json")


def test_default_output_is_under_the_working_directory_not_the_checkout():
    path = benchmark.default_output_path("cpu", quick=True)
    assert not path.is_absolute() and path.parts[:2] == ("dml-optim-out", "bench")


def test_default_output_folder_is_ignored_by_git():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert "dml-optim-out/" in lines


def test_the_cpu_construction_target_is_one_copy_plus_the_largest_tensor():
    """On the CPU the pack holds one tensor twice at most: gpt2's token embedding (50257 x 768) is
    31% of its 124,439,808 elements, so the CPU target is 1.36; a device keeps the 1.25 target, and
    a CPU model of small tensors keeps it too."""
    from dml_optim.benchmark.memory import memory_limit

    share = 50257 * 768 / benchmark.workload("gpt2").trainable_numel
    assert round(share, 4) == 0.3102
    assert memory_limit(torch.device("cpu"), share) == 1.36
    assert memory_limit(torch.device("cuda"), share) == 1.25
    assert memory_limit(torch.device("cpu"), 0.08) == 1.25


def test_the_low_bit_row_measures_ours_and_says_which_peers_are_missing(monkeypatch):
    """The low-bit row at its quick size: every candidate available or 'not installed', state bytes read from
    each optimizer's own tensors (ours: codes + scales of one 1M tensor, exactly 2 * (1 + 4/256) and
    2 * (1/2 + 4/128)), and its target in the document."""
    import importlib.util

    from dml_optim.benchmark import lowbit

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    from dml_optim.benchmark.run import settings_for

    settings = dict(settings_for("cpu", True), rounds=1, min_rounds=1, warmup=0, max_inner=1)
    record = lowbit.measure_lowbit(torch.device("cpu"), torch.float32, settings, lambda m: None, quick=True)
    rows = {r["candidate"]: r for r in record["rows"]}
    assert set(rows) == set(lowbit.CANDIDATES)
    assert rows["dml_optim 8-bit"]["state_bytes_per_param"] == 2 * (1 + 4 / 256)
    assert rows["dml_optim 4-bit"]["state_bytes_per_param"] == 2 * (0.5 + 4 / 128)
    assert rows["torch fused"]["state_bytes_per_param"] == 8
    assert rows["torchao AdamW4bit"]["reason"].startswith("not installed")
    assert rows["dml_optim 8-bit"]["ratio_to_fused"] > 0
    doc = {"device": "cpu", "results": [], "references": [], "lowbit": [record]}
    (target,) = [t for t in benchmark.check_targets(doc) if "8-bit" in t["target"]]
    assert target["target"] == "one-1m AdamW 8-bit >= 1.0x bitsandbytes AdamW8bit"
    assert (target["status"] == "not measured") is (not rows["bitsandbytes AdamW8bit"]["available"])


def test_the_cpu_bandwidth_reference_is_an_in_place_add_that_a_fused_step_stays_under():
    """The CPU reference writes back what it reads, as a fused optimizer step does (the triad it replaced
    pays a write-allocate, so fused steps read above 100% of it).  The reference updates ``a`` in place
    and moves 3 elements per element; its name follows the document (older ones say triad)."""
    from dml_optim.benchmark.timing import Reference, reference_name

    ref = Reference(1024, torch.device("cpu"), torch.float32)
    assert ref.kind == "inplace-add" and ref.bytes_moved == 3 * 4 * 1024
    a, b = ref.a.clone(), ref.b.clone()
    ref.step()
    torch.testing.assert_close(ref.a, a + 0.5 * b, rtol=0, atol=0)  # in place: the same storage, updated
    assert reference_name({"references": [{"reference": "inplace-add"}]}) == "the in-place add"
    assert reference_name({"references": [{"reference": "triad"}]}) == "the triad"
