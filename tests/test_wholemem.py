"""The whole-training memory measurement (dml_optim/benchmark/wholemem.py).

One subprocess runs a small configuration (torch.optim.AdamW FP32 on a 1M-parameter MLP) with a known
allocation held through a second window of the measured steps: the smoke test of the child and the test
that the counter sees every live byte.  The rest (statuses, the document, the table) runs no subprocess.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from dml_optim.benchmark import wholemem
from dml_optim.benchmark.wholemem import (
    CONFIGS, LEAN_FP16, NOT_ON_DIRECTML, RECOMMENDED, Config, availability, format_table, measure, measure_one,
)

linux_only = pytest.mark.skipif(not (sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")),
                                reason="the CPU's peak is read from /proc/self/status and reset through clear_refs (Linux)")

#: The known allocation (MiB) and how far the measured growth may be from it (MiB): page rounding, the
#: interpreter's own small allocations between the two windows.
EXTRA_MIB, MARGIN_MIB = 64, 6


@pytest.fixture(scope="module")
def child():
    return measure_one(dict(config="torch-fp32", set_to_none=True, model="mlp-small", device="cpu", warmup=1,
                            steps=2, extra_bytes=EXTRA_MIB << 20), timeout=600)


@linux_only
@pytest.mark.slow
def test_a_small_configuration_measures_in_a_subprocess(child):
    assert "error" not in child, child.get("error")
    n = child["params"]
    assert n == wholemem.count_params(wholemem.MODELS["mlp-small"])
    ar = child["arithmetic_bytes"]
    assert ar["params"] == ar["grads"] == 4 * n and ar["state"] == 8 * n  # two FP32 moments
    # every live byte counted: at least parameters, gradients and both moments at the peak
    assert child["peak_bytes"] >= 0.95 * ar["total"]
    assert child["peak_bytes_with_libraries"] >= child["peak_bytes"]
    assert "clip_grad_norm_" in child["loop"] and "set_to_none=True" in child["loop"]
    assert len(child["losses"]) == 1 + 2 + 2 and all(l == l for l in child["losses"])


@linux_only
@pytest.mark.slow
def test_the_counter_sees_a_known_allocation(child):
    """A 64 MiB tensor held through the measured steps raises the peak by 64 MiB, within the margin."""
    assert "error" not in child, child.get("error")
    grown = (child["peak_extra_bytes"] - child["peak_bytes"]) / 2**20
    assert abs(grown - EXTRA_MIB) <= MARGIN_MIB, grown


def test_statuses_without_a_subprocess():
    missing = Config("x", "x", "bitsandbytes", peer="no_such_module_for_dml_optim_tests")
    status, why = availability(missing)
    assert status == "not installed" and "no_such_module_for_dml_optim_tests" in why
    assert availability(wholemem.config("torch-fp32")) == ("available", None)
    for cfg in CONFIGS:
        if cfg.phase2:
            status, why = availability(cfg)
            assert status in ("available", "not available yet")
            assert (why is None) == (status == "available")
    # rows that cannot run are recorded without starting a child
    doc = measure(["ours-bf16-sr-8bit-eager"], model="mlp-small", log=lambda _: None)
    rows = doc["rows"]
    assert [r["zero_grad"] for r in rows] == ["set_to_none=True", "set_to_none=False"]
    if rows[0]["status"] != "measured":
        assert rows[0]["status"] == "not available yet" and "rounding" in rows[0]["reason"]
        assert rows[0]["ratio_to_reference"] is None
    json.dumps(doc)  # the document is JSON


def test_table_and_ratios_from_a_document():
    doc = {"model": {"description": "m", "params": 10}, "rows": []}
    for key, style, peak in [("torch-fp32", True, 200), ("torch-fp32", False, 190), ("ours-8bit-eager", True, 100)]:
        doc["rows"].append({"config": key, "label": wholemem.config(key).label, "set_to_none": style,
                            "status": "measured", "peak_bytes": peak, "peak_bytes_per_param": peak / 10,
                            "arithmetic_bytes_per_param": 16.0})
    doc["rows"].append({"config": "bnb-8bit", "label": "bnb", "set_to_none": True, "status": "not installed",
                        "reason": "no"})
    wholemem.add_ratios(doc)
    assert [r["ratio_to_reference"] for r in doc["rows"]] == [1.0, 1.0, 0.5, None]
    table = format_table(doc)
    assert "| dml_optim.AdamW(state_bits=8), eager | yes | 10.00 (0.50x) |  | 16.00 |" in table
    assert "| bnb | no (no DirectML backend) | not installed |  |  |" in table
    assert set(wholemem.row_fields()) >= {"config", "zero_grad", "status", "peak_bytes_per_param",
                                          "ratio_to_reference", "arithmetic_bytes_per_param"}


def test_configuration_keys_are_unique_and_the_reference_exists():
    keys = [c.key for c in CONFIGS]
    assert len(keys) == len(set(keys)) and wholemem.REFERENCE in keys
    with pytest.raises(ValueError, match="unknown configuration"):
        wholemem.config("nope")


def test_directml_s_lean_configuration_is_float16_with_loss_scaling_inside_backward():
    """Issue 49: DirectML has no bfloat16, so its lean rows are float16 + stochastic rounding + 8/4-bit state, eager,
    the step inside backward with a DynamicLossScaler; every bfloat16 row says it does not run on DirectML."""
    assert LEAN_FP16 == ("ours-fp16-sr-8bit-eager-backward", "ours-fp16-sr-4bit-eager-backward")
    for key, bits in zip(LEAN_FP16, (8, 4)):
        cfg = wholemem.config(key)
        assert (cfg.family, cfg.dtype, cfg.directml) == ("dml_optim", "float16", RECOMMENDED)
        assert cfg.kwargs == {"backend": "eager", "rounding": "stochastic", "state_bits": bits}
        assert {"rounding", "backward", "scaler"} <= set(cfg.phase2)
        assert availability(cfg) == ("available", None)
    kahan = wholemem.config("ours-fp16-kahan-8bit-eager-backward")
    assert kahan.dtype == "float16" and "scaler" in kahan.phase2 and kahan.kwargs["kahan"] is True
    bf16 = [c for c in CONFIGS if c.dtype == "bfloat16"]
    assert {"ours-bf16-sr-8bit-eager-backward", "ours-bf16-sr-4bit-eager-backward", "torch-bf16"} <= {c.key for c in bf16}
    assert all(c.directml == NOT_ON_DIRECTML for c in bf16)
    assert all(c.directml and c.directml != NOT_ON_DIRECTML for c in CONFIGS if c.dtype != "bfloat16")
    # the lean float16 rows are the only recommended ones
    assert {c.key for c in CONFIGS if c.directml == RECOMMENDED} == set(LEAN_FP16)


def test_the_scaled_loop_is_what_the_float16_rows_run():
    """The float16 rows' iteration: the loss scaled, each run unscaled and stepped inside backward, the scaler
    updated; the parameters move and the scaler saw every backward (no subprocess: the loop itself)."""
    import torch

    cfg = wholemem.config("ours-fp16-sr-8bit-eager-backward")
    opt, params, iterate, loop = wholemem.training_loop(cfg, wholemem.MODELS["tiny"], torch.device("cpu"), True)
    assert "scaler.scale(loss).backward()" in loop and "scaler.update()" in loop and "clip" not in loop.split(";")[0]
    before = [p.detach().clone() for p in params]
    losses = [float(iterate()) for _ in range(3)]
    assert all(l == l for l in losses) and all(p.dtype == torch.float16 for p in params)
    assert any(not torch.equal(p, q) for p, q in zip(params, before))  # stepped inside backward
    assert all(p.grad is None for p in params)  # no gradient left after the step inside backward
    assert opt.param_groups[0]["rounding"] == "stochastic" and opt.param_groups[0]["state_bits"] == 8


@linux_only
@pytest.mark.slow
def test_the_float16_lean_row_measures_in_a_subprocess():
    res = measure_one(dict(config="ours-fp16-sr-8bit-eager-backward", set_to_none=True, model="mlp-small",
                           device="cpu", warmup=1, steps=2), timeout=600)
    assert "error" not in res, res.get("error")
    n, ar = res["params"], res["arithmetic_bytes"]
    assert ar["params"] == ar["grads"] == 2 * n  # float16
    assert ar["state"] < 2.1 * n  # two 8-bit states and their block scales
    assert res["backend"] == "eager" and "scaler.scale(loss)" in res["loop"]
    assert res["peak_bytes"] > 2 * n and all(l == l for l in res["losses"])


def test_the_committed_result_measured_the_float16_lean_rows():
    """bench/results/memory-2026-12-07.json: the float16 lean rows measured in both zero_grad styles, each row saying
    whether it runs on DirectML, the bfloat16 ones that they do not."""
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parent.parent / "bench/results/memory-2026-12-07.json").read_text())
    rows = {(r["config"], r["set_to_none"]): r for r in doc["rows"]}
    for key in (wholemem.REFERENCE, *LEAN_FP16, "ours-bf16-sr-8bit-eager-backward", "ours-bf16-sr-4bit-eager-backward"):
        for style in (True, False):
            r = rows[(key, style)]
            assert r["status"] == "measured" and not r.get("carried_from") and r["peak_bytes"] > 0, (key, style)
    assert all(r["directml"] == NOT_ON_DIRECTML for r in doc["rows"] if r["dtype"] == "bfloat16")
    assert all(rows[(k, True)]["directml"] == RECOMMENDED and rows[(k, True)]["dtype"] == "float16" for k in LEAN_FP16)
    assert "scaler.scale(loss).backward()" in rows[(LEAN_FP16[0], True)]["loop"]
