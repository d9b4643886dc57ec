"""The package's layering: no import cycles, every module importable on its own."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import import_cycles  # noqa: E402


def test_no_import_cycles():
    graph = import_cycles.module_graph(ROOT / "dml_optim")
    assert "dml_optim.optimizers.base" in graph and graph["dml_optim.options"] <= set()  # the leaf imports nothing of ours
    assert import_cycles.cycles(graph) == []


def test_the_checker_finds_a_cycle():
    assert import_cycles.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("module", ["dml_optim.steps", "dml_optim.optimizers.registry"])
def test_a_module_imports_in_a_fresh_interpreter(module):
    """Importing a lower layer first must not need a higher one to be loaded already."""
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_optimizer_facts_are_class_attributes_not_isinstance_tests():
    """Facts about one optimizer live on its class (e.g. DmlAdam's step limit), not in isinstance tests elsewhere."""
    offenders = []
    for path in (ROOT / "dml_optim").rglob("*.py"):
        text = path.read_text()
        for name in ("DmlAdam", "AdamW", "Momentum", "Adagrad"):
            if f"isinstance(opt, {name})" in text or f"isinstance(optimizer, {name})" in text:
                offenders.append(f"{path.name}: isinstance(..., {name})")
    assert offenders == []
    importlib.import_module("dml_optim")


def test_every_design_reference_points_inside_the_repository():
    """Code, tests, tools, data and docs cite docs/design.md, which is in the repository, and its sections exist."""
    import re

    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, flags=re.M))
    offenders, cited = [], set()
    files = [p for d in ("dml_optim", "tests", "tools", "bench", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".json", ".toml")]
    for path in [*files, ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        if re.search(r"\b" + "DE" + r"SIGN(\.md)?\b(?!_)", text):  # spelled apart so this file does not match
            offenders.append(str(path.relative_to(ROOT)))
        cited |= set(re.findall(r"docs/design\.md`? §(\d+)", text))
    assert offenders == [], "cites the design brief outside the repository instead of docs/design.md"
    assert cited and cited <= sections, f"cited sections {sorted(cited - sections)} do not exist in docs/design.md"
