"""``dml_optim.precision.compare`` and ``dml-optim compare`` (issue 6): also its header,
progress, default output folder and model names.

The metrics themselves are checked on constructed cases in
``tests/test_precision.py``; here: the report has every metric for every
configuration and stream, the findings follow from the numbers, and the
command writes report.md, report.json and a PNG with one line per
configuration and stream.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dml_optim import precision as P
from dml_optim.cli import main


@pytest.fixture(scope="module")
def dml_adam_report():
    return P.compare("dml-adam", steps=6, seed=1)


def test_compare_has_every_metric_for_every_configuration(dml_adam_report):
    rep = dml_adam_report
    pairs = {(r.config, r.stream) for r in rep.results}
    assert pairs == {(c, s) for c in ("fp32", "fp16", "fp16-fp32compute", "fp16-master", "fp16-kahan", "fp16-sr",
                                      "fp32-8bit", "fp32-4bit", "fp16-kahan-8bit", "fp16-kahan-4bit", "fp16-sr-8bit",
                                      "fp16-sr-4bit")
                     for s in ("recorded", "synthetic")}
    for r in rep.results:
        assert set(r.metrics) == set(P.METRICS)
        assert len(r.curve) == 6
    # DmlAdam: FLOAT32 or FLOAT16, as DirectML
    assert {s["config"] for s in rep.skipped} == {"bf16", "bf16-kahan", "bf16-sr", "bf16-sr-8bit", "bf16-sr-4bit"}
    recorded = {r.config: r.metrics for r in rep.results if r.stream == "recorded"}
    assert recorded["fp16"]["first_nonfinite_step"] == 1  # epsilon 1e-8 is 0 in FP16
    assert recorded["fp32"]["final_loss"] is not None and math.isfinite(recorded["fp32"]["final_loss"])
    assert any("epsilon 1e-08 is 0 in FP16" in f for f in rep.findings)
    assert any(f.startswith("`bf16` skipped") for f in rep.findings)
    assert "dml_optim.Adam with alpha=beta1" in rep.reference  # DmlAdam has no float64: ONNX Adam is its reference


def test_synthetic_stream_spans_1e_8_to_1e2():
    init = torch.zeros(20000)
    s = P.synthetic_stream(init, [(20000,)], 2, seed=0)
    g = s.grad(1).abs()
    assert g.min() >= 1e-8 * (1 - 1e-6) and g.max() <= 1e2 * (1 + 1e-6)
    assert g.min() < 1e-7 and g.max() > 10  # the whole range is used
    assert torch.equal(s.grad(2), P.synthetic_stream(init, [(20000,)], 2, seed=0).grad(2))  # deterministic


def test_compare_rejects_bad_arguments():
    with pytest.raises(ValueError, match="optimizer"):
        P.compare("sophia", steps=1)
    with pytest.raises(ValueError, match="steps"):
        P.compare("adam", steps=0)
    with pytest.raises(ValueError, match="recorded"):
        P.compare("adam", steps=1, workload="tiny-mlp", streams=["recorded"])


def test_compare_command_writes_report_json_and_png(tmp_path, capsys):
    mpimg = pytest.importorskip("matplotlib.image", reason="the PNG check needs matplotlib (the plot extra)")
    assert main(["compare", "--steps", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "fp16-master" in out and "findings:" in out
    for name in ("report.md", "report.json", "divergence.png"):
        assert (tmp_path / name).stat().st_size > 0
    image = mpimg.imread(tmp_path / "divergence.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    doc = json.loads((tmp_path / "report.json").read_text())
    n_configs, n_streams = len(doc["configs"]), len(doc["streams"])
    assert (n_configs, n_streams) == (17, 2)
    assert {"fp16-sr-8bit", "fp16-sr-4bit"} <= {c["name"] for c in doc["configs"]}  # DirectML's lean configuration
    assert [c["name"] for c in doc["configs"]] == list(P.CONFIGS)
    assert doc["command"] == ("dml-optim compare --optimizer adam --workload mlp --steps 4 --seed 0 "
                              f"--streams recorded,synthetic --configs {','.join(P.CONFIGS)}")
    assert doc["plot"]["lines"] == n_configs * n_streams
    assert len(doc["results"]) == n_configs * n_streams
    for r in doc["results"]:
        assert set(r["metrics"]) == set(P.METRICS)
    markdown = (tmp_path / "report.md").read_text()
    assert "![relative error per step](divergence.png)" in markdown
    assert f"Command: `{doc['command']}`" in markdown


def test_compare_command_on_an_inventory(tmp_path):
    assert main(["compare", "--workload", "tiny-mlp", "--optimizer", "momentum", "--steps", "2",
                 "--configs", "fp32,fp16", "--out", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in doc["streams"]] == ["gaussian", "synthetic"]
    assert doc["plot"]["lines"] == 4


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"),
    (["--workload", "no-such-model"], "--workload"),
    (["--configs", "fp8"], "--configs"),
    (["--optimizer", "momentum", "--epsilon", "1e-4"], "--epsilon"),
    (["--workload", "tiny-mlp", "--streams", "recorded"], "--streams"),
])
def test_compare_command_usage_errors(argv, flag, capsys, tmp_path):
    assert main(["compare", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]


def test_findings_follow_the_numbers():
    rep = P.compare("adam", steps=5, seed=2, configs=["fp16", "fp16-master"], streams=["synthetic"])
    m = {r.config: r.metrics for r in rep.results}
    # FP16 state: (1 - beta) g^2 flushes for |g| < 5.5e-3 (about half of the log-uniform 1e-8..1e2 range);
    # FP32 state (fp16-master): zeros only where the gradient itself underflowed in FP16 storage
    assert m["fp16"]["flushed_second_moment_fraction"] > 0.4
    assert 0 < m["fp16-master"]["flushed_second_moment_fraction"] < 0.05
    flushed = [f for f in rep.findings if "flushed to zero" in f]
    assert len(flushed) == 1 and flushed[0].startswith("`fp16` (synthetic stream)")
    master = [f for f in rep.findings if f.startswith("`fp16-master`") and "second-moment" in f]
    assert len(master) == 1 and "became 0 when stored in FP16" in master[0]
    assert f"{100 * m['fp16']['flushed_second_moment_fraction']:.3g}%" in flushed[0]
    assert "every |g| below 0.0055" in flushed[0]  # sqrt(2**-25 / (1 - 0.999))
    lost = [f for f in rep.findings if "lost to rounding" in f]
    assert [f.split(" ")[0] for f in lost] == (["`fp16`"] if m["fp16"]["lost_update_fraction"] >= 0.01 else [])


def test_kahan_findings_quote_fp32_and_fp16_master():
    rep = P.compare("adam", steps=5, seed=2, configs=["fp32", "fp16", "fp16-master", "fp16-kahan"], streams=["synthetic"])
    m = {r.config: r.metrics for r in rep.results}
    kahan = [f for f in rep.findings if f.startswith("`fp16-kahan` (synthetic stream): FP16 parameters plus")]
    assert len(kahan) == 1
    text = kahan[0]
    assert "2-byte compensation buffer" in text and "FP32 master weights take 4" in text
    for name in ("fp16-kahan", "fp32", "fp16-master"):
        assert f"{m[name]['final_rel_error']:.3g}" in text, name
    ratio = m["fp16-kahan"]["final_rel_error"] / m["fp16-master"]["final_rel_error"]
    assert f"({ratio:.2f} times `fp16-master`'s)" in text
    assert f"plain `fp16` on the same stream ends at {m['fp16']['final_rel_error']:.3g}" in text
    # Kahan carries the updates FP16 rounding drops: no "lost to rounding" finding for it, one for plain fp16
    assert [f.split(" ")[0] for f in rep.findings if "lost to rounding" in f] == (
        ["`fp16`"] if m["fp16"]["lost_update_fraction"] >= 0.01 else [])


def test_low_bit_findings_quote_their_memory_and_the_full_precision_twin():
    rep = P.compare("adamw", steps=5, seed=2, configs=["fp32", "fp16-kahan", "fp32-8bit", "fp16-kahan-4bit"],
                    streams=["recorded"])
    m = {r.config: r.metrics for r in rep.results}
    eight = next(f for f in rep.findings if f.startswith("`fp32-8bit` (recorded stream): states stored in 8 bits"))
    assert "2.03 bytes per parameter for 2 states, instead of 8 in FP32" in eight  # 2 * (1 + 4/256)
    assert f"{m['fp32-8bit']['final_rel_error']:.3g}" in eight and f"{m['fp32']['final_rel_error']:.3g} for `fp32`" in eight
    four = next(f for f in rep.findings if f.startswith("`fp16-kahan-4bit` (recorded stream): states stored in 4 bits"))
    assert "1.06 bytes per parameter" in four and "for `fp16-kahan` (the same with FP32 states)" in four
    assert "power code (levels (k/15)^2)" in four and "asinh-companded code" in four  # (codebook dml-optim-blockwise-3)
    assert "signed fourth-root code (levels (k/127)^4)" in eight and "fourth-root code (levels (k/255)^4)" in eight
    # the 8-bit state drifts less than the 4-bit one, and both more than FP32 arithmetic alone
    assert m["fp32"]["final_rel_error"] < m["fp32-8bit"]["final_rel_error"] < m["fp16-kahan-4bit"]["final_rel_error"]


SR_CONFIGS = {"fp16-sr": (torch.float16, None), "bf16-sr": (torch.bfloat16, None),
              "fp16-sr-8bit": (torch.float16, 8), "fp16-sr-4bit": (torch.float16, 4),
              "bf16-sr-8bit": (torch.bfloat16, 8), "bf16-sr-4bit": (torch.bfloat16, 4)}


def test_stochastic_rounding_configurations_reach_the_optimizer():
    # issue 32 item 3: compare runs rounding="stochastic" (no Kahan, no master copy), with FP32 and 8/4-bit states
    assert set(SR_CONFIGS) <= set(P.CONFIGS)
    for name, (dtype, bits) in SR_CONFIGS.items():
        config = P.CONFIGS[name]
        assert (config.param_dtype, config.state_bits, config.rounding) == (dtype, bits, "stochastic")
        assert config.stochastic and not config.carries_small_updates
        assert config.options()["rounding"] == "stochastic"
        opt = P.make_optimizer("adam", [torch.nn.Parameter(torch.ones(8, dtype=dtype))], config)
        group = opt.param_groups[0]
        assert (group["rounding"], group["kahan"], group["master_weights"], group["state_bits"]) == (
            "stochastic", False, False, bits)
        assert config.arithmetic_dtype == torch.float32
    # a round-to-nearest configuration passes the options it always did (no rounding key)
    assert all("rounding" not in c.options() for c in P.CONFIGS.values() if not c.stochastic)


def test_stochastic_rounding_findings_quote_the_run_and_kahan():
    names = ["bf16", "bf16-kahan", "bf16-sr", "fp16-kahan-8bit", "bf16-sr-8bit"]
    rep = P.compare("adam", steps=6, seed=3, configs=names, streams=["synthetic"])
    m = {r.config: r.metrics for r in rep.results}
    curves = {r.config: r.curve for r in rep.results}
    err = {n: m[n]["final_rel_error"] for n in names}
    sr = next(f for f in rep.findings if f.startswith("`bf16-sr` (synthetic stream): BF16 parameters written by "
                                                      "stochastic rounding"))
    assert "no compensation buffer" in sr and f"end at relative error {err['bf16-sr']:.3g}" in sr
    assert f"`bf16` ({err['bf16']:.3g}" in sr or f"plain `bf16` ({err['bf16']:.3g}" in sr
    # the verdicts follow the measured errors, whichever way they go
    assert (": closer to the reference than plain `bf16`" in sr) == (err["bf16-sr"] < err["bf16"])
    assert (": not closer to the reference than plain `bf16`" in sr) == (err["bf16-sr"] >= err["bf16"])
    if err["bf16-sr"] < err["bf16"]:  # and from which step on, read from the curves
        below = [x < y for x, y in zip(curves["bf16-sr"], curves["bf16"])]
        since = next(t for t in range(1, 7) if all(below[t - 1:]))
        assert (f"below it from step {since} of 6 on" if since > 1 else "below it at every one of the 6 steps") in sr
    assert ("`bf16-kahan` is still closer" in sr) == (err["bf16-kahan"] < err["bf16-sr"])
    assert f"({err['bf16-kahan']:.3g}" in sr and "2-byte compensation buffer per parameter" in sr
    smaller = sum(k < s for k, s in zip(curves["bf16-kahan"], curves["bf16-sr"]))
    assert f"Kahan's error was the smaller at {smaller} of the 6 steps" in sr
    # no "lost to rounding" advice for stochastic rounding: its small updates are kept on average
    assert not any(f.startswith("`bf16-sr") and "lost to rounding" in f for f in rep.findings)
    low = next(f for f in rep.findings if f.startswith("`bf16-sr-8bit` (synthetic stream): states stored in 8 bits"))
    assert f"{err['bf16-sr']:.3g} for `bf16-sr` (the same with FP32 states)" in low
    assert f"`fp16-kahan-8bit` (FP16 parameters with the same 8-bit states" in low
    assert f"ends at {err['fp16-kahan-8bit']:.3g}" in low


def test_stochastic_rounding_runs_are_reproducible_under_the_seed():
    init = (torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()
    stream = P.synthetic_stream(init, [(2000,)], 4, seed=0)
    before = torch.get_rng_state()
    curves = [P.run_stream("adam", stream, [P.CONFIGS["bf16-sr"]], seed=seed)[0][0].curve for seed in (4, 4, 5)]
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state is left as it was
    assert curves[0] == curves[1] and curves[0] != curves[2]  # the same stream: only the rounding's draws differ


def test_compare_adamw_names_its_epsilon_eps(tmp_path):
    # AdamW calls its epsilon eps: --epsilon sets it, and the FP16 finding names it
    rep = P.compare("adamw", steps=2, configs=["fp16"], streams=["synthetic"])
    assert rep.hyperparameters["eps"] == 1e-8 and rep.hyperparameters["weight_decay"] == 0.01
    assert any(f.startswith("`fp16` (synthetic stream): eps 1e-08 is 0 in FP16") for f in rep.findings)
    assert main(["compare", "--optimizer", "adamw", "--epsilon", "1e-4", "--steps", "2", "--configs", "fp16,fp16-kahan",
                 "--streams", "recorded", "--out", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["hyperparameters"]["eps"] == 1e-4 and "epsilon" not in doc["hyperparameters"]
    assert doc["command"].endswith("--configs fp16,fp16-kahan --epsilon 0.0001")
    assert doc["streams"][0]["name"] == "recorded" and "FP32 adamw training run" in doc["streams"][0]["description"]
    assert {r["config"] for r in doc["results"]} == {"fp16", "fp16-kahan"}


def test_report_json_is_strict_json_with_nan_as_strings(tmp_path):
    assert main(["compare", "--optimizer", "dml-adam", "--steps", "2", "--configs", "fp16",
                 "--streams", "synthetic", "--out", str(tmp_path), "--no-progress"]) == 0

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    doc = json.loads((tmp_path / "report.json").read_text(), parse_constant=refuse)
    metrics = doc["results"][0]["metrics"]
    assert metrics["first_nonfinite_step"] == 1 and metrics["max_rel_error"] == "inf"
    assert doc["results"][0]["rel_error_per_step"] == ["nan", "nan"]


def test_compare_command_without_matplotlib_writes_md_and_json(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now raises ImportError
    assert main(["compare", "--steps", "2", "--configs", "fp32", "--streams", "synthetic",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.json").exists()
    assert not (tmp_path / "divergence.png").exists()
    assert "pip install 'dml-optim[plot]'" in capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["plot"] is None and any("dml-optim[plot]" in n for n in doc["notes"])


def test_compare_reports_progress_to_the_caller():
    calls = []
    P.compare("momentum", steps=3, workload="tiny-mlp", configs=["fp32"], progress=lambda *c: calls.append(c))
    assert calls == [(1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6)]


def test_compare_command_header_progress_and_default_folder(tmp_path, monkeypatch, capsys):
    # issue items 6 and 7: a header and progress before the 45-s silence of an inventory run;
    # the report goes to ./dml-optim-out/compare, not ./compare-report
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--workload", "many-small-2", "--optimizer", "momentum", "--steps", "10",
                 "--configs", "fp32,fp16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("dml-optim compare: momentum on many-small-2 (2 tensors, 2,048 parameters), 10 steps per "
                        "stream (gaussian, synthetic), configurations fp32, fp16; about 1 MB of memory; "
                        "report to dml-optim-out/compare")
    assert lines[1:11] == [f"compare: step {k}/20 ({5 * k}%)" for k in range(2, 21, 2)]
    assert lines[11].startswith("momentum on many-small-2: 10 steps per stream")
    assert (tmp_path / "dml-optim-out" / "compare" / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dml-optim-out"]


def test_compare_command_takes_the_model_names_of_every_command(tmp_path):
    from dml_optim.inventory import models_dir

    for workload in ("tiny-mlp", str(models_dir() / "tiny-mlp.json")):
        out = tmp_path / workload.replace("/", "_")
        assert main(["compare", "--workload", workload, "--steps", "1", "--configs", "fp32", "--streams", "synthetic",
                     "--out", str(out), "--no-progress"]) == 0
        assert json.loads((out / "report.json").read_text())["workload"] == "tiny-mlp"


def test_directml_s_lean_configuration_is_compared_beside_kahan_and_its_bf16_twin():
    """Issue 49: compare runs fp16-sr-8bit (DirectML's lean configuration: it has no bfloat16); its finding quotes
    fp16-sr (the same with FP32 states) and fp16-kahan-8bit, and bf16-sr-8bit's finding quotes its FP16 twin."""
    names = ["fp16-sr", "fp16-kahan-8bit", "fp16-sr-8bit", "bf16-sr-8bit"]
    rep = P.compare("adamw", steps=5, seed=2, configs=names, streams=["recorded"])
    err = {r.config: r.metrics["final_rel_error"] for r in rep.results}
    assert set(err) == set(names) and all(math.isfinite(e) for e in err.values())
    assert "DirectML's lean configuration" in P.CONFIGS["fp16-sr-8bit"].description
    assert all("CPU/CUDA only" in c.description for n, c in P.CONFIGS.items() if n.startswith("bf16"))
    lean = next(f for f in rep.findings if f.startswith("`fp16-sr-8bit` (recorded stream): states stored in 8 bits"))
    assert f"against {err['fp16-sr']:.3g} for `fp16-sr` (the same with FP32 states)" in lean
    assert f"`fp16-kahan-8bit` (FP16 parameters with the same 8-bit states" in lean
    assert "does not run on DirectML" not in lean
    twin = next(f for f in rep.findings if f.startswith("`bf16-sr-8bit` (recorded stream): states stored in 8 bits"))
    assert (f"BF16 does not run on DirectML (it has none): `fp16-sr-8bit`, the same in FP16 (DirectML's lean "
            f"configuration), ends at {err['fp16-sr-8bit']:.3g}") in twin
