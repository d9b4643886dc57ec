"""``dml_optim/data/shapes/descriptors``: every case through the CLI, exit status and rule ids as it expects.

Each file states ``"expect": {"exit": ..., "rules": [...]}`` inside itself; the
loader ignores ``expect`` and ``description`` (see the folder's README.md).
"""

from __future__ import annotations

import json
import re

import pytest

from _desc_helpers import corpus_files, read_expect, run_cli
from dml_optim.dml.desc import MalformedDescriptor
from dml_optim.dml.desc_json import dumps, load, loads
from dml_optim.dml.validate import RULES

FILES = corpus_files()
IDS = [p.stem for p in FILES]
LINE = re.compile(r"^(error|warning) (\S+) ([a-z-]+): .+$")


def test_corpus_size_and_coverage():
    assert len(FILES) >= 30
    expects = [read_expect(p) for p in FILES]
    assert {r for e in expects for r in e["rules"]} == set(RULES)  # every rule id has a case
    assert {e["exit"] for e in expects} == {0, 1, 2}
    for path, e in zip(FILES, expects):
        assert set(e) == {"exit", "rules"}, path.name
        assert set(e["rules"]) <= set(RULES), path.name
        assert (e["exit"] == 2) <= (e["rules"] == []), path.name  # malformed cases report no rules
        errors = [r for r in e["rules"] if RULES[r] == "error"]
        assert (e["exit"] == 1) == bool(errors), path.name


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_case_through_cli_json(capsys, path):
    expect = read_expect(path)
    rc, out, err = run_cli(capsys, "validate", str(path), "--json")
    assert rc == expect["exit"], err or out
    data = json.loads(out)
    if expect["exit"] == 2:
        assert "malformed" in data and err.count("\n") == 1
        return
    assert err == ""
    assert {v["rule"] for v in data["violations"]} == set(expect["rules"])
    assert data["valid"] is (expect["exit"] == 0)


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_case_through_cli_text(capsys, path):
    expect = read_expect(path)
    rc, out, err = run_cli(capsys, "validate", str(path))
    assert rc == expect["exit"]
    if expect["exit"] == 2:
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err
        return
    *lines, verdict = out.splitlines()
    assert {LINE.match(line).group(3) for line in lines} == set(expect["rules"])
    assert verdict.startswith(f"{path}: {'valid' if expect['exit'] == 0 else 'INVALID'} at feature level ")


@pytest.mark.parametrize("path", [p for p in FILES if read_expect(p)["exit"] != 2], ids=lambda p: p.stem)
def test_case_round_trips_and_ignores_annotations(path):
    desc = load(path)
    assert loads(dumps(desc)) == desc
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert "description" in raw and "expect" in raw
    del raw["description"], raw["expect"]
    assert loads(json.dumps(raw)) == desc


@pytest.mark.parametrize("path", [p for p in FILES if read_expect(p)["exit"] == 2], ids=lambda p: p.stem)
def test_malformed_cases_raise(path):
    with pytest.raises(MalformedDescriptor):
        load(path)
