"""The package's layering: no import cycles, every module importable on its own."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import import_cycles  # noqa: E402


def test_no_import_cycles_and_every_import_within_its_layer():
    graph = import_cycles.module_graph(ROOT / "dml_optim")
    assert "dml_optim.optimizers.base" in graph and graph["dml_optim.core.options"] <= set()  # the leaf imports nothing of ours
    assert import_cycles.cycles(graph) == []
    assert import_cycles.layer_violations(ROOT / "dml_optim", graph) == []


def test_every_module_is_short_or_says_why():
    assert import_cycles.long_modules(ROOT / "dml_optim") == []


def test_the_checker_finds_a_cycle():
    assert import_cycles.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def _package(tmp_path, files):
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_a_cycle_through_a_function_level_import(tmp_path):
    """A lazy import inside a function is a dependency: a cycle through one is found; TYPE_CHECKING is not."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg.high import g\n    return g\n",
        "high.py": "from pkg import low\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import g\n",
    })
    graph = import_cycles.module_graph(root)
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.typed"] == set()
    assert import_cycles.cycles(graph) == [["pkg.high", "pkg.low", "pkg.high"]]
    assert import_cycles.main(["import_cycles", str(root)]) == 1


def test_the_checker_refuses_an_import_into_a_layer_not_allowed(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": '"""Lowest.\n\nMay import: nothing of pkg outside core.\n"""\n',
        "core/a.py": "def f():\n    from pkg.upper import b\n",
        "upper/__init__.py": '"""Above.\n\nMay import: core.\n"""\n',
        "upper/b.py": "from pkg.core import a\n",
    })
    graph = import_cycles.module_graph(root)
    assert import_cycles.layer_violations(root, graph) == [
        "pkg.core.a -> pkg.upper.b (core may import: nothing)"]


@pytest.mark.parametrize("module", ["dml_optim.core.steps", "dml_optim.core.dtypes", "dml_optim.backends.base",
                                    "dml_optim.backends.eager", "dml_optim.backends.choose", "dml_optim.optimizers.registry"])
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
