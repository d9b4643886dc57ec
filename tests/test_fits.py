"""The largest-model search (dml_optim/benchmark/fits.py): the search logic against a known peak line, and one
real child measurement of a GPT given by its fields (not a named model)."""

from __future__ import annotations

import pytest

from dml_optim.benchmark.fits import WIDTH_SPEC, largest_fitting
from dml_optim.benchmark.wholemem import measure_one


@pytest.mark.parametrize("budget, expected", [(1000, 18), (1050, 19), (1049, 18), (150, 1), (149, 0)])
def test_the_deepest_fitting_depth_is_measured_and_the_next_is_measured_not_to_fit(budget, expected):
    calls = []

    def peak_of(d):
        calls.append(d)
        return 100 + 50 * d

    depth, peaks = largest_fitting(peak_of, budget)
    assert depth == expected
    assert all(peaks[d] == 100 + 50 * d for d in peaks) and len(calls) == len(set(calls))  # (each depth once)
    if depth:
        assert peaks[depth] <= budget and peaks[depth + 1] > budget
    else:
        assert peaks[1] > budget


def test_a_line_that_bends_still_ends_on_a_measured_boundary():
    """Peaks that grow faster than the two probes say (activations): the walk from the guess still stops where
    one depth fits and the next does not."""
    depth, peaks = largest_fitting(lambda d: 10 * d * d, 2000)
    assert depth == 14 and peaks[14] <= 2000 < peaks[15]


def test_a_child_measures_a_gpt_given_by_its_fields():
    spec = dict(WIDTH_SPEC, name="gpt-64x1", width=64, heads=4, vocab=256, seq=16, depth=1)
    result = measure_one({"config": "torch-fp32", "model": spec, "set_to_none": True, "device": "cpu",
                          "warmup": 1, "steps": 1}, timeout=300)
    assert "error" not in result, result
    assert result["model"] == "gpt-64x1" and result["params"] > 12 * 64 * 64  # (one block and the embedding)
    assert result["peak_bytes"] > 4 * result["params"]  # (at least the parameters' own bytes)


def test_the_lean_rows_are_directml_s_float16_configuration():
    from dml_optim.benchmark.fits import CONFIGS
    from dml_optim.benchmark.wholemem import LEAN_FP16, config

    assert CONFIGS == ("torch-fp32", *LEAN_FP16)
    assert all(config(k).dtype == "float16" and "scaler" in config(k).phase2 for k in LEAN_FP16)


def test_the_line_is_a_least_squares_fit_and_the_extrapolation_follows_it():
    from dml_optim.benchmark.fits import extrapolate, fit_line, params_at

    assert fit_line({2: 300, 6: 500, 10: 700}) == pytest.approx((200, 50))
    with pytest.raises(ValueError, match="two measured depths"):
        fit_line({3: 1})
    a, b = 0.21e9, 50e6  # a known line (no budget on a whole depth); depth 2 off it (the first probe is left out)
    row = {"config": "x", "label": "x", "measured": {str(d): {"peak_bytes": int(a + b * d) + (10**8 if d == 2 else 0)}
                                                    for d in (2, 6, 30, 31)}}
    line = extrapolate(row, (8.0, 12.0))
    assert line["points"] == [6, 30, 31] and line["intercept_bytes"] == pytest.approx(a, abs=2)
    assert line["bytes_per_block"] == pytest.approx(b, abs=1) and line["max_residual_bytes"] <= 1
    for entry in line["budgets"]:
        d, budget = entry["depth"], entry["budget_gb"] * 1e9
        assert a + b * d <= budget < a + b * (d + 1)
        assert entry["params"] == params_at(d) and entry["predicted_peak_bytes"] == pytest.approx(a + b * d, abs=2)


def test_parameters_are_counted_without_building_the_model():
    """A 24 GB card's depth counts billions of parameters: counted on the meta device, nothing allocated."""
    from dml_optim.benchmark.fits import params_at

    per_block = 12 * 1024 * 1024 + 13 * 1024  # qkv, proj, up, down and their biases, two LayerNorms
    assert params_at(1000) - params_at(999) == per_block
    assert params_at(1000) == 8192 * 1024 + 32 * 1024 + 2 * 1024 + 1000 * per_block  # embedding, positions, final norm


def test_the_committed_run_extrapolates_from_its_measured_depths():
    """bench/results/fits-2026-12-07.json: torch FP32 and the float16 lean rows measured at 2 GB, and their lines
    extrapolated to 8, 12 and 24 GB from those measured depths (said so), each depth the line's."""
    import json
    import math
    from pathlib import Path

    from dml_optim.benchmark.fits import fit_line
    from dml_optim.benchmark.wholemem import LEAN_FP16

    doc = json.loads((Path(__file__).resolve().parent.parent / "bench/results/fits-2026-12-07.json").read_text())
    assert [r["config"] for r in doc["rows"]] == ["torch-fp32", *LEAN_FP16]
    extra = doc["extrapolated"]
    assert "extrapolated, not measured" in extra["method"]
    for row, line in zip(doc["rows"], extra["rows"]):
        assert line["config"] == row["config"] and [b["budget_gb"] for b in line["budgets"]] == [8.0, 12.0, 24.0]
        points = {int(d): m["peak_bytes"] for d, m in row["measured"].items() if int(d) >= 6}
        assert sorted(points) == line["points"]
        a, b = fit_line(points)
        for entry in line["budgets"]:
            assert entry["depth"] == math.floor((entry["budget_gb"] * 1e9 - a) / b)
    lean = {line["config"]: line for line in extra["rows"]}
    torch_line = next(line for line in extra["rows"] if line["config"] == "torch-fp32")
    for key in LEAN_FP16:  # the lean configuration trains deeper models than torch FP32 at every budget
        assert all(x["params"] > 3 * t["params"] for x, t in zip(lean[key]["budgets"], torch_line["budgets"]))
