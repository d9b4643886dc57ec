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


# -- the tests use the public seams only ------------------------------------------------------------------

#: Private names that are torch's (or a framework's) protocol, which dml_optim implements too: a test may read
#: them as it would on torch.optim's objects.
_PROTOCOL = {"_step_supports_amp_scaling", "_opt_called", "_growth_tracker", "_optimizers", "_reset_state", "_base"}


def _private_reads(test_files) -> list[str]:
    """``file:line: name`` for each read of a private name of dml_optim in ``test_files``: an import of a private
    name or module of dml_optim, an attribute chain through a private name rooted at something imported from
    dml_optim, a private attribute (or ``setattr``/``getattr`` string) that dml_optim defines and the tests do not,
    read off any other object (an optimizer, a buffer)."""
    import ast

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def defined(paths) -> set[str]:
        names = set()
        for path in paths:
            for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    names.add(n.attr)
                elif isinstance(n, ast.arg):
                    names.add(n.arg)
        return {x for x in names if private(x)}

    library = defined((ROOT / "dml_optim").rglob("*.py")) - _PROTOCOL
    own = defined(test_files)
    found = []
    for path in test_files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        ours, foreign = set(), set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    (ours if a.name.split(".")[0] == "dml_optim" else foreign).add((a.asname or a.name).split(".")[0])
            elif isinstance(n, ast.ImportFrom) and n.module:
                is_ours = n.module.split(".")[0] == "dml_optim"
                for a in n.names:
                    (ours if is_ours else foreign).add(a.asname or a.name)
                    if is_ours and private(a.name):
                        found.append(f"{path.name}:{n.lineno}: {n.module}.{a.name}")
                if is_ours and any(map(private, n.module.split("."))):
                    found.append(f"{path.name}:{n.lineno}: {n.module}")
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and private(n.attr):
                root = n
                while isinstance(root, ast.Attribute):
                    root = root.value
                name = root.id if isinstance(root, ast.Name) else None
                if name in ours or (name not in foreign and n.attr in library and n.attr not in own):
                    found.append(f"{path.name}:{n.lineno}: .{n.attr}")
            elif (isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
                  and getattr(n.func, "attr", getattr(n.func, "id", None)) in ("setattr", "getattr", "hasattr", "delattr")
                  and n.args[1].value in library and n.args[1].value not in own):
                found.append(f"{path.name}:{n.lineno}: {n.args[1].value!r}")
    return sorted(found)


def test_no_test_reads_a_private_name_of_the_package():
    """The tests reach the library through its public seams (the ``repeat`` option, ``flat_buffers()``,
    ``step_requests()``, :mod:`dml_optim.testing`): a refactoring of the insides breaks no test."""
    assert _private_reads(sorted((ROOT / "tests").rglob("*.py"))) == []


def test_the_private_name_check_finds_each_kind_of_read(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import dml_optim\n"
        "from dml_optim.backends import compiled\n"
        "from dml_optim.backends.compiled import _KERNELS\n"
        "import torch\n"
        "compiled._BROKEN.clear()\n"
        "opt = dml_optim.AdamW([torch.nn.Parameter(torch.zeros(2))])\n"
        "opt._steady\n"
        "setattr(opt, '_steady', None)\n"
        "torch._C._get_tracing_state\n"        # torch's own private: not ours
        "opt._step_supports_amp_scaling\n",    # torch's protocol: allowed
        encoding="utf-8")
    found = _private_reads([probe])
    assert found == sorted(["test_probe.py:3: dml_optim.backends.compiled._KERNELS", "test_probe.py:5: ._BROKEN",
                            "test_probe.py:7: ._steady", "test_probe.py:8: '_steady'"]), found


def test_the_optimizers_reach_the_backends_through_choose_only():
    """Every module of dml_optim.optimizers (engine and layout among them) imports ``backends.choose`` and nothing
    else of backends/, function-level imports included: one decision point, one seam."""
    import ast

    found, seen = [], set()
    paths = sorted((ROOT / "dml_optim" / "optimizers").rglob("*.py"))
    assert {"engine.py", "layout.py"} <= {p.name for p in paths}  # (the check reads the modules it is about)
    for path in paths:
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and n.module:
                modules = ([f"{n.module}.{a.name}" for a in n.names] if n.module == "dml_optim.backends"
                           else [n.module])
            elif isinstance(n, ast.Import):
                modules = [a.name for a in n.names]
            else:
                continue
            seen.update(m for m in modules if m.startswith("dml_optim.backends"))
            found += [f"{path.name}:{n.lineno}: {m}" for m in modules
                      if m.startswith("dml_optim.backends") and m != "dml_optim.backends.choose"]
    assert found == []
    assert "dml_optim.backends.choose" in seen  # (the seam is what they import)
