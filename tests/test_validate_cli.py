"""``dml-optim validate``: output format, exit statuses, --json, --feature-level, --model.

Runs the CLI in-process through ``dml_optim.cli.main`` (fast), plus one real
``python -m dml_optim validate`` subprocess smoke test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _desc_helpers import CORPUS_DIR, MODELS_DIR, REPO, base_dict, mutated, run_cli

VALID = str(CORPUS_DIR / "valid-fp32-inplace.json")
WARN = str(CORPUS_DIR / "warn-training-step-zero.json")
INVALID = str(CORPUS_DIR / "many-violations.json")
MALFORMED = str(CORPUS_DIR / "malformed-negative-size.json")
NOT_JSON = str(CORPUS_DIR / "malformed-not-json.json")
LINE = re.compile(r"^(error|warning) (\S+) ([a-z-]+): (.+)$")


def _write(tmp_path: Path, name: str, obj) -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


def test_valid_file_text_output(capsys):
    rc, out, err = run_cli(capsys, "validate", VALID)
    assert (rc, err) == (0, "")
    assert out == f"{VALID}: valid at feature level 3_0 (0 errors, 0 warnings)\n"


def test_warning_still_exits_0(capsys):
    rc, out, err = run_cli(capsys, "validate", WARN)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert LINE.match(lines[0]).groups()[:3] == ("warning", "TrainingStepValue", "training-step-zero")
    assert lines[-1] == f"{WARN}: valid at feature level 3_0 (0 errors, 1 warning)"


def test_invalid_file_lists_every_violation(capsys):
    rc, out, err = run_cli(capsys, "validate", INVALID)
    assert rc == 1 and err == ""
    *lines, verdict = out.splitlines()
    parsed = [LINE.match(line).groups()[:3] for line in lines]
    assert parsed == [
        ("error", "GradientTensor.DataType", "data-type"),
        ("error", "GradientTensor.DataType", "same-data-type"),
        ("error", "Beta2", "hyperparameter"),
        ("warning", "Epsilon", "epsilon-underflow"),
        ("error", "Bindings.InputSecondMomentTensor.Offset", "binding-offset-alignment"),
        ("error", "Bindings.OutputSecondMomentTensor", "alias"),
        ("warning", "TrainingStepValue", "training-step-zero"),
    ]
    assert verdict == f"{INVALID}: INVALID at feature level 3_0 (5 errors, 2 warnings)"


@pytest.mark.parametrize("path", [MALFORMED, NOT_JSON, "/nonexistent/desc.json"])
def test_malformed_is_one_line_on_stderr_exit_2(capsys, path):
    rc, out, err = run_cli(capsys, "validate", path)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"dml-optim validate: error: {path}: malformed descriptor: ")
    assert "Traceback" not in err


def test_malformed_reason_names_field_and_value(capsys):
    _, _, err = run_cli(capsys, "validate", MALFORMED)
    assert "GradientTensor.Sizes[2] = -1 does not fit in UINT" in err


def test_json_single_and_several(capsys):
    rc, out, _ = run_cli(capsys, "validate", INVALID, "--json")
    data = json.loads(out)
    assert rc == 1
    assert data["file"] == INVALID and data["valid"] is False and data["feature_level"] == "3_0"
    assert {"field": "Beta2", "rule": "hyperparameter", "severity": "error"}.items() <= data["violations"][2].items()
    rc, out, err = run_cli(capsys, "validate", VALID, WARN, MALFORMED, "--json")
    data = json.loads(out)
    assert rc == 2 and err.count("\n") == 1
    assert [d["file"] for d in data] == [VALID, WARN, MALFORMED]
    assert [d["valid"] for d in data] == [True, True, False]
    assert "GradientTensor.Sizes[2]" in data[2]["malformed"]


@pytest.mark.parametrize(
    "files, status",
    [([VALID, WARN], 0), ([VALID, INVALID], 1), ([INVALID, VALID], 1), ([INVALID, MALFORMED], 2),
     ([MALFORMED, VALID], 2)],
)
def test_several_files_worst_status(capsys, files, status):
    rc, out, _ = run_cli(capsys, "validate", *files)
    assert rc == status
    verdicts = [line for line in out.splitlines() if not LINE.match(line)]
    assert len(verdicts) == sum(f != MALFORMED for f in files)  # every readable file is reported


def test_feature_level_override(capsys):
    two_d = str(CORPUS_DIR / "dimension-count-fl3-2d.json")
    assert run_cli(capsys, "validate", two_d)[0] == 1
    rc, out, _ = run_cli(capsys, "validate", two_d, "--feature-level", "4_0")
    assert rc == 0 and "valid at feature level 4_0" in out
    rc, _, err = run_cli(capsys, "validate", two_d, "--feature-level", "9_9")
    assert rc == 2 and err.count("\n") == 1 and '--feature-level = "9_9"' in err


def test_stdin(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(mutated(base_dict(), Beta1=7.0))))
    rc, out, _ = run_cli(capsys, "validate", "-")
    assert rc == 1 and out.splitlines()[-1].startswith("<stdin>: INVALID")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["validate"], "give at least one descriptor FILE, or --model MODEL"),
        (["validate", VALID, "--model", str(MODELS_DIR / "tiny-mlp.json")], "either FILEs or --model"),
        (["validate", VALID, "--dtype", "float16"], "--dtype and --epsilon apply only with --model"),
        (["validate", VALID, "--epsilon", "1e-4"], "--dtype and --epsilon apply only with --model"),
        (["validate", "--model", "x.json", "--dtype", "int8"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_one_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and needle in err and err.count("\n") == 1


def test_help_has_examples(capsys):
    rc, out, _ = run_cli(capsys, "validate", "--help")
    assert rc == 0
    assert "examples:" in out and "dml-optim validate --model gpt2 --dtype float16" in out


# ---------------------------------------------------------------------------
# --model
# ---------------------------------------------------------------------------

TINY = str(MODELS_DIR / "tiny-mlp.json")


def test_model_tiny_mlp_float32(capsys):
    # tiny-mlp: 6 tensors, 32*64 + 64 + 64*32 + 32 + 32*10 + 10 = 4522 elements, 4522 * 4 = 18088 bytes
    rc, out, err = run_cli(capsys, "validate", "--model", TINY)
    assert rc == 0 and err == ""
    assert "6 parameter tensors, 4,522 elements, FLOAT32" in out
    assert "18,088 bytes per buffer" in out
    assert "6 in-place ADAM_OPTIMIZER descriptors" in out
    assert out.splitlines()[-1] == "tiny-mlp: valid at feature level 3_0 (0 errors, 0 warnings)"


def test_model_float16_warns_about_epsilon(capsys):
    rc, out, _ = run_cli(capsys, "validate", "--model", TINY, "--dtype", "float16", "--json")
    data = json.loads(out)
    assert rc == 0
    assert data["bytes_per_buffer"] == 9044  # 4522 * 2
    assert data["per_parameter"] == {"descriptors": 6, "errors": 0, "warnings": 6}
    assert data["flat"]["chunks"] == [4522] and data["flat"]["warnings"] == 1
    assert {v["rule"] for v in data["violations"]} == {"epsilon-underflow"}
    rc, out, _ = run_cli(capsys, "validate", "--model", TINY, "--dtype", "float16", "--epsilon", "1e-4")
    assert rc == 0 and out.splitlines()[-1].endswith("(0 errors, 0 warnings)")


def test_model_over_uint32_elements_is_split(capsys, tmp_path):
    # 65536 * 65537 = 4295032832 elements > 2^32 - 1: the flat buffer is split into
    # 4294967280 (the largest multiple of 16 <= 2^32 - 1) + 65552; the per-parameter
    # descriptor [1, 1, 65536, 65537] itself breaks element-count.
    inv = {"name": "huge", "source": "synthetic", "total_parameters": 4295032832,
           "parameters": [{"name": "w", "shape": [65536, 65537]}]}
    rc, out, _ = run_cli(capsys, "validate", "--model", _write(tmp_path, "huge.json", inv), "--json")
    data = json.loads(out)
    assert rc == 1
    assert data["flat"]["chunks"] == [4294967280, 65552]
    assert data["flat"]["errors"] == 0
    assert data["bytes_per_buffer"] == 17180131328  # 4295032832 * 4
    assert {(v["descriptor"], v["rule"]) for v in data["violations"]} == {("per-parameter:w", "element-count")}


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"name": "x"})])
def test_model_bad_path_or_file_exit_2(capsys, tmp_path, content):
    path = str(tmp_path / "missing.json") if content is None else _write(tmp_path, "bad.json", content)
    rc, out, err = run_cli(capsys, "validate", "--model", path)
    assert rc == 2 and out == ""
    assert err.startswith("dml-optim validate: error: --model: ") and err.count("\n") == 1


# ---------------------------------------------------------------------------
# Never a traceback
# ---------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.text(max_size=30),
    _JSON.map(json.dumps),
    st.sampled_from(["GradientTensor", "Bindings", "Beta1", "TrainingStepValue", "feature_level"]).flatmap(
        lambda key: _JSON.map(lambda v: json.dumps({**base_dict(), key: v}))),
))
def test_cli_never_prints_a_traceback(capsys, text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.json"
        path.write_text(text, encoding="utf-8")
        rc, out, err = run_cli(capsys, "validate", str(path))
    assert rc in (0, 1, 2)
    assert "Traceback" not in out + err
    if rc == 2:
        assert err.count("\n") == 1 and out == ""


def test_subprocess_smoke():
    """One real process: the module entry point, several files, the worst status."""
    proc = subprocess.run(
        [sys.executable, "-m", "dml_optim", "validate", VALID, MALFORMED],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == f"{VALID}: valid at feature level 3_0 (0 errors, 0 warnings)\n"
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
