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
from dml_optim.benchmark.wholemem import CONFIGS, Config, availability, format_table, measure, measure_one

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
    wholemem._ratios(doc)
    assert [r["ratio_to_reference"] for r in doc["rows"]] == [1.0, 1.0, 0.5, None]
    table = format_table(doc)
    assert "| dml_optim.AdamW(state_bits=8), eager | 10.00 (0.50x) |  | 16.00 |" in table
    assert "| bnb | not installed |  |  |" in table
    assert set(wholemem.row_fields()) >= {"config", "zero_grad", "status", "peak_bytes_per_param",
                                          "ratio_to_reference", "arithmetic_bytes_per_param"}


def test_configuration_keys_are_unique_and_the_reference_exists():
    keys = [c.key for c in CONFIGS]
    assert len(keys) == len(set(keys)) and wholemem.REFERENCE in keys
    with pytest.raises(ValueError, match="unknown configuration"):
        wholemem.config("nope")
