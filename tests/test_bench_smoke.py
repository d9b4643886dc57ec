"""Smoke test of the benchmark (``dml-optim bench --quick`` / ``bench/run.py --quick``).

Checks the shape of what it writes and prints, where it writes it, its
header and progress, and its usage errors; never its speed.
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
from dml_optim.cli import main

ROOT = Path(__file__).resolve().parent.parent
ROW_FIELDS = {
    "optimizer", "workload", "candidate", "available", "reason", "ms_per_step", "steps_per_s",
    "ratio_to_best_torch", "gbs", "fraction_of_triad", "ops_per_step", "optimizer_bytes",
    "first_step_ms", "compile_s", "samples", "inner_steps",
}
NUMERIC = ("ms_per_step", "steps_per_s", "ratio_to_best_torch", "gbs", "fraction_of_triad", "first_step_ms")


@pytest.mark.slow
def test_quick_benchmark_writes_every_candidate(tmp_path, monkeypatch, capsys):
    # from a folder that is not the checkout, without --out: the result goes to
    # ./dml-optim-out/bench/, and no bench/results/ appears there (issue item 7)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick"]) == 0
    (out,) = (tmp_path / "dml-optim-out" / "bench").glob("cpu-*-quick.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dml-optim-out"]
    doc = json.loads(out.read_text())
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("dml-optim bench --quick: device cpu, optimizers adam, adagrad, momentum, "
                               "workloads many-small-256; results to dml-optim-out/bench/cpu-")
    progress = [line for line in lines if line.startswith("bench: group ")]
    assert progress == [f"bench: group {k}/3 ({100 * k // 3}%)  {o} on many-small-256"
                        for k, o in enumerate(benchmark.OPTIMIZERS, 1)]
    assert lines.index(progress[-1]) < lines.index(next(line for line in lines if line.startswith("| optimizer |")))

    assert doc["schema"] == 1 and doc["quick"] is True and doc["device"] == "cpu"
    for key in ("created", "dtype", "machine", "settings", "candidates", "workloads", "results", "references", "targets"):
        assert key in doc, key
    assert doc["candidates"] == list(benchmark.CANDIDATES)
    assert [w["name"] for w in doc["workloads"]] == list(benchmark.QUICK_WORKLOADS)

    expected = {(o, w, c) for o in benchmark.OPTIMIZERS for w in benchmark.QUICK_WORKLOADS for c in benchmark.CANDIDATES}
    seen = {(r["optimizer"], r["workload"], r["candidate"]) for r in doc["results"]}
    assert seen == expected and len(doc["results"]) == len(expected)
    for r in doc["results"]:
        assert set(r) == ROW_FIELDS, r["candidate"]
        if r["candidate"].startswith("dml_optim"):
            compile_ok = compiled.compile_available("cpu")[0]
            assert r["available"] or (r["candidate"].endswith("compiled") and not compile_ok), r
        if not r["available"]:
            assert isinstance(r["reason"], str) and r["reason"], r  # n/a says why
            continue
        assert r["reason"] is None
        for f in NUMERIC:
            assert isinstance(r[f], float) and math.isfinite(r[f]) and r[f] > 0, (r["candidate"], f, r[f])
        assert isinstance(r["ops_per_step"], int) and r["ops_per_step"] >= 1
        assert isinstance(r["optimizer_bytes"], int) and r["optimizer_bytes"] > 0
        assert r["samples"] >= doc["settings"]["min_rounds"]
        assert (r["compile_s"] is not None) == (r["candidate"] == "dml_optim compiled")
    # the best torch variant has ratio 1 by definition
    for o in benchmark.OPTIMIZERS:
        ratios = [r["ratio_to_best_torch"] for r in doc["results"]
                  if r["optimizer"] == o and r["candidate"].startswith("torch") and r["available"]]
        assert max(ratios) == pytest.approx(1.0)
    assert len(doc["references"]) == len(benchmark.OPTIMIZERS) * len(benchmark.QUICK_WORKLOADS)
    for ref in doc["references"]:
        assert ref["triad_gbs"] > 0 and ref["auto_backend"] in ("eager", "compiled")
    assert all(t["status"] in ("PASS", "MISS", "not measured") for t in doc["targets"])
    assert "| optimizer | workload | candidate | ms/step |" in printed
    assert "| target |" in printed and f"wrote {out.relative_to(tmp_path)}" in printed


def test_op_counts_reflect_the_implementation():
    """Eager Adam is a handful of ops over one buffer; torch's for-loop is ~10 per tensor."""
    import torch

    import dml_optim

    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(20)]
    for p in params:
        p.grad = torch.randn(8)
    ours = dml_optim.Adam(params, backend="eager")
    n_ours = benchmark.count_ops(ours.step)
    theirs_params = [torch.nn.Parameter(torch.randn(8)) for _ in range(20)]
    for p in theirs_params:
        p.grad = torch.randn(8)
    theirs = torch.optim.Adam(theirs_params, foreach=False)
    theirs.step()
    n_theirs = benchmark.count_ops(theirs.step)
    assert 3 <= n_ours <= 12  # independent of the number of tensors
    assert n_theirs >= 5 * len(params)


def test_bench_rejects_an_unknown_workload(capsys):
    assert main(["bench", "--quick", "--workloads", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workloads" in err[0] and "no-such-model" in err[0] and "resnet50" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is NOT usable")
def test_bench_on_an_unusable_device_is_a_usage_error(tmp_path, capsys):
    # once `error: RuntimeError: ...` and status 1, unlike every other command
    assert main(["bench", "--quick", "--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dml-optim bench: error: --device: device 'cuda' is not usable: ")
    assert not (tmp_path / "x.json").exists()


def test_workloads_are_the_models_of_every_command():
    from dml_optim.inventory import models_dir

    assert benchmark.workload("tiny-mlp") == benchmark.workload(str(models_dir() / "tiny-mlp.json"))
    assert len(benchmark.workload("many-small").shapes) == 2000
    assert benchmark.workload("one-64m").shapes == ((2**26,),)


def test_bench_script_runs_from_a_checkout():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--device" in proc.stdout and "examples:" in proc.stdout


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
