"""Check the package's layering: no import cycle, no import of a layer a package may not import, no long module.

Usage: ``python tools/import_cycles.py [package_dir]`` (default ``dml_optim``).
Exit status 1 on a cycle or a layer violation.

Every import counts, wherever it is written: at module level, inside a
function or a method (a lazy import is still a dependency: it runs the first
time the function does).  Only imports under ``if TYPE_CHECKING:`` are left
out, since they never run.

Each subpackage's ``__init__`` docstring ends its text with one line
``May import: core, dml, ...`` naming the other subpackages its modules may
import (``top`` stands for the loose modules at the package's top,
``nothing of <package> outside <name>`` for none).  The loose modules at the
top (the command line, the audit, ...) may import any layer.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

#: Modules over this many lines are listed, unless their docstring says why they are long ("Long by design: ...").
LONG_MODULE_LINES = 450


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the statements under ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def imports_of(path: Path, modules: dict[str, Path], package: str) -> set[str]:
    """The package modules ``path`` imports anywhere in its text (functions included, TYPE_CHECKING blocks not)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    deps: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            deps.update(subs)
            if len(subs) < len(node.names):
                deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
    return deps


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module name → the package modules it imports (anywhere in the module)."""
    modules = _modules(root)
    return {name: {d for d in imports_of(path, modules, root.name) if d in modules and d != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each as a path that closes on itself)."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif not state.get(nxt):
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [])
    return found


def layer_of(module: str, root: Path) -> str:
    """The subpackage a module belongs to, or ``top`` for the loose modules and the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (root / parts[1]).is_dir() else "top"


def allowed_layers(root: Path) -> dict[str, set[str]]:
    """Subpackage → the layers its ``May import:`` line names (a subpackage without the line is reported)."""
    allowed = {}
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = re.search(r"^May import: (.*?)\.?$", doc, flags=re.M)
        if match is None:
            raise ValueError(f"{init.relative_to(root.parent)}: its docstring has no 'May import:' line")
        text = match.group(1)
        allowed[init.parent.name] = set() if text.startswith("nothing") else {w.strip() for w in text.split(",")}
    return allowed


def layer_violations(root: Path, graph: dict[str, set[str]]) -> list[str]:
    """Each import from a subpackage into a layer its docstring does not allow, as ``a -> b``."""
    allowed = allowed_layers(root)
    bad = []
    for module, deps in sorted(graph.items()):
        layer = layer_of(module, root)
        if layer == "top":
            continue
        for dep in sorted(deps):
            target = layer_of(dep, root)
            if target != layer and target not in allowed[layer]:
                bad.append(f"{module} -> {dep} ({layer} may import: {', '.join(sorted(allowed[layer])) or 'nothing'})")
    return bad


def long_modules(root: Path) -> list[str]:
    """Modules over :data:`LONG_MODULE_LINES` lines whose docstring gives no reason (``Long by design: ...``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        n = len(text.splitlines())
        doc = ast.get_docstring(ast.parse(text)) or ""
        if n > LONG_MODULE_LINES and "Long by design:" not in doc:
            out.append(f"{path.relative_to(root.parent)} ({n} lines)")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "dml_optim")
    graph = module_graph(root)
    found = cycles(graph)
    for cycle in found:
        print("cycle: " + " -> ".join(cycle))
    bad = layer_violations(root, graph)
    for line in bad:
        print("layer: " + line)
    for line in long_modules(root):
        print("long module without a reason: " + line)
    print("no import cycles" if not found else f"{len(found)} import cycle(s)")
    return 1 if found or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
