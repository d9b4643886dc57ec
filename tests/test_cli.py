"""The ``dml-optim`` command line as a whole: help, examples, version, and one-line usage errors.

The bad-argument cases are derived from the parsers themselves (every option
with choices gets a bad choice, every numeric option a non-number), so a new
option is covered without editing this file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import dml_optim
from dml_optim.cli import COMMANDS, build_parser, main

EXPECTED_COMMANDS = ("train", "info", "validate", "audit", "compare", "bench")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _exit_code(argv: list[str]) -> int:
    """Run ``main(argv)``; argparse exits through SystemExit, our commands return."""
    try:
        return main(argv)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code


def _is_numeric_type(kind) -> bool:
    if kind is None:
        return False
    try:
        value = kind("1")
    except Exception:
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad_choice_cases() -> list[tuple[str, str]]:
    return [(cmd, a.option_strings[-1]) for cmd, p in _subparsers().items() for a in p._actions
            if a.option_strings and a.choices is not None]


def _bad_number_cases() -> list[tuple[str, str]]:
    return [(cmd, a.option_strings[-1]) for cmd, p in _subparsers().items() for a in p._actions
            if a.option_strings and a.choices is None and _is_numeric_type(a.type)]


def test_commands_are_the_documented_six():
    assert COMMANDS == EXPECTED_COMMANDS
    assert tuple(_subparsers()) == EXPECTED_COMMANDS


def test_top_level_help_lists_every_command(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED_COMMANDS:
        assert f"    {name}" in out, f"{name} missing from dml-optim --help"


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dml-optim {dml_optim.__version__}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert _exit_code([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: dml-optim")
    assert all(name in out for name in EXPECTED_COMMANDS)


@pytest.mark.parametrize("command", EXPECTED_COMMANDS)
def test_subcommand_help_has_examples(command, capsys):
    assert _exit_code([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dml-optim {command}")
    assert "examples:" in out
    example_lines = [line for line in out.splitlines() if line.strip().startswith(f"dml-optim {command}")]
    assert example_lines, f"dml-optim {command} --help shows no example command line"


def _assert_one_line_usage_error(argv: list[str], capsys) -> str:
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got {captured.err!r}"
    assert "error" in lines[0] and "Traceback" not in captured.err
    return lines[0]


def _required_args(command: str) -> list[str]:
    """Values for the command's required arguments (so argparse gets to the unknown option)."""
    argv = []
    for a in _subparsers()[command]._actions:
        if not a.required:
            continue
        value = a.choices[0] if a.choices else "placeholder.json"
        argv += [a.option_strings[-1], value] if a.option_strings else [value]
    return argv


@pytest.mark.parametrize("command", EXPECTED_COMMANDS)
def test_unknown_option_is_one_line_exit_2(command, capsys):
    line = _assert_one_line_usage_error([command, *_required_args(command), "--no-such-option"], capsys)
    assert "--no-such-option" in line


@pytest.mark.parametrize("command,option", _bad_choice_cases())
def test_bad_choice_is_one_line_exit_2(command, option, capsys):
    line = _assert_one_line_usage_error([command, option, "no-such-choice"], capsys)
    assert "no-such-choice" in line


@pytest.mark.parametrize("command,option", _bad_number_cases())
def test_bad_number_is_one_line_exit_2(command, option, capsys):
    line = _assert_one_line_usage_error([command, option, "not-a-number"], capsys)
    assert option in line


def test_derived_cases_cover_train():
    # guards the derivation above: train's choices and numbers must be among the cases
    assert {("train", "--optimizer"), ("train", "--dtype"), ("train", "--device")} <= set(_bad_choice_cases())
    assert {("train", o) for o in ("--lr", "--steps", "--batch-size", "--seed", "--threads")} <= set(_bad_number_cases())


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "0"],
    ["train", "--lr", "-0.1"],
    ["train", "--lr", "nan"],
    ["train", "--batch-size", "1.5"],
    ["train", "--seed", "-1"],
])
def test_train_rejects_out_of_range_values(argv, capsys):
    line = _assert_one_line_usage_error(argv, capsys)
    assert argv[1] in line and repr(argv[2]) in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is NOT usable")
def test_train_unusable_device_is_a_usage_error(capsys):
    line = _assert_one_line_usage_error(["train", "--device", "cuda"], capsys)
    assert line.startswith("dml-optim train: error: --device:") and "'cuda'" in line and "not usable" in line


def test_train_unusable_directml_names_the_reason(capsys):
    from dml_optim.dml.device import available

    ok, reason = available()
    if ok:
        pytest.skip("a DirectML device is usable here; the error path cannot be reached")
    line = _assert_one_line_usage_error(["train", "--device", "privateuseone"], capsys)
    assert "'privateuseone'" in line and reason in line


def test_usage_error_in_a_subprocess_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "dml_optim", "train", "--steps", "zero"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dml-optim train: error: argument --steps: expected a positive integer, got 'zero'"]
    assert proc.stdout == ""


def _help_examples() -> list[str]:
    """The example command lines of every subcommand's --help."""
    sub = _subparsers()
    return [line.split("#")[0].strip() for name in COMMANDS for line in (sub[name].epilog or "").splitlines()
            if line.strip().startswith("dml-optim ")]


def test_every_file_named_in_a_help_example_exists():
    """Examples in --help must run as written from a checkout (a renamed corpus
    file once left `dml-optim validate`'s first example failing with exit 2)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    named = [path for line in _help_examples() for path in re.findall(r"(?:docs|examples|bench)/[\w./-]+\.(?:json|py|md)", line)]
    missing = [path for path in named if not (root / path).exists()]
    assert missing == []


def test_every_model_named_in_a_help_example_resolves_by_name():
    """The help's models are names, not paths into a checkout (`compare --workload gpt2` from
    an installed wheel once failed); `my-*.json` stands for the user's own file."""
    from dml_optim.inventory import resolve_model

    models = []
    for line in _help_examples():
        words = line.split()
        for flag in ("--model", "--workload", "--workloads"):
            if flag in words:
                values = words[words.index(flag) + 1:]
                models += values[:1] if flag != "--workloads" else [v for v in values if not v.startswith("-")]
    assert {"resnet50", "gpt2"} <= set(models), models
    for model in models:
        assert "/" not in model, f"help example names a path: {model}"
        if model == "mlp" or model.startswith("my-"):
            continue
        resolve_model(model)


# ----------------------------------------------------------------------------
# one error convention for every subcommand: one line on stderr, status 2
# ----------------------------------------------------------------------------

def _no_cuda() -> bool:
    return not torch.cuda.is_available()


#: (command, argv after the command, words the one line must hold); at least one per subcommand,
#: past argparse (an unusable device, an unknown model, an unwritable output path).
USAGE_ERRORS = [
    ("train", ["--device", "privateuseone"], ["--device", "'privateuseone'"]),
    ("info", ["--jsn"], ["--jsn"]),
    ("validate", ["--model", "resnet"], ["--model", "unknown model 'resnet'", "resnet50"]),
    ("validate", ["--model", "gpt2", "--feature-level", "9_9"], ["--feature-level", "9_9"]),
    ("audit", ["--optimizer", "adam", "--model", "gpt3"], ["--model", "unknown model 'gpt3'", "gpt2"]),
    ("compare", ["--workload", "resnet"], ["--workload", "unknown model 'resnet'", "resnet50"]),
    ("compare", ["--out", "{file}/sub"], ["--out", "{file}"]),
    ("bench", ["--workloads", "resnet"], ["--workloads", "unknown model 'resnet'", "resnet50"]),
    ("bench", ["--out", "{file}/sub/x.json"], ["--out", "{file}"]),
    ("bench", ["--out", "{dir}"], ["--out", "is a directory"]),
    pytest.param("bench", ["--device", "cuda"], ["--device", "'cuda'", "not usable"],
                 marks=pytest.mark.skipif(not _no_cuda(), reason="needs a machine where CUDA is NOT usable")),
]


def test_usage_error_cases_cover_every_command():
    covered = {case.values[0] if hasattr(case, "values") else case[0] for case in USAGE_ERRORS}
    assert covered == set(COMMANDS)


@pytest.mark.parametrize("command,argv,words", USAGE_ERRORS)
def test_usage_errors_are_one_line_and_status_2(command, argv, words, tmp_path, capsys):
    from dml_optim.dml.device import available

    if command == "train" and available()[0]:
        pytest.skip("a DirectML device is usable here")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    subst = {"{file}": str(blocker), "{dir}": str(tmp_path)}

    def fill(text):
        for key, value in subst.items():
            text = text.replace(key, value)
        return text

    line = _assert_one_line_usage_error([command, *map(fill, argv)], capsys)
    assert line.startswith(f"dml-optim {command}: error: "), line
    for word in words:
        assert fill(word) in line, (word, line)
