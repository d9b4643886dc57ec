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
