"""Check that the package's module-level imports form no cycle, and list modules over 500 lines.

Usage: ``python tools/import_cycles.py [package_dir]`` (default ``dml_optim``).
Exit status 1 if there is a cycle.  Imports inside functions and under
``if TYPE_CHECKING:`` are not module-level and are not counted: they are how
a lower layer refers to a higher one lazily.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module name → the package modules it imports at module level."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


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


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "dml_optim")
    found = cycles(module_graph(root))
    for cycle in found:
        print("cycle: " + " -> ".join(cycle))
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > 500:
            print(f"long module ({n} lines): {path.relative_to(root.parent)}")
    print("no import cycles" if not found else f"{len(found)} import cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
