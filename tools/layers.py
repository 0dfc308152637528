"""The library's import graph: which package each module of pipeline/ imports (anywhere in it, lazily too), checked
against the order of pipeline/__init__.py: no package imports one after it, and no module cycle.

    python -m tools.layers      # prints each upward import and cycle (exit 1 if any)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDER = (  # the packages, lowest first
    *("core", "data", "tracking", "checkpoints", "model", "kernels"),
    *("launching", "training", "merge", "evaluation", "export"),
)
TOP = ("cli", "check", "__main__")  # above every package


def imports(root: Path = REPO) -> dict[str, set[str]]:
    """{module: modules of pipeline it imports}, dotted (a package's __init__ by the package's name)."""
    graph = {}
    for path in (root / "pipeline").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("pipeline."))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = found
    known = set(graph)
    # `from pipeline.core import atomic` names a module; `from pipeline.core.atomic import read_json` its attribute
    return {name: {m if m in known else m.rsplit(".", 1)[0] for m in found} - {name} for name, found in graph.items()}


def rank(module: str) -> int:
    """The position of `module`'s package in ORDER (TOP modules after every package)."""
    part = module.split(".")[1] if module.count(".") else ""
    return ORDER.index(part) if part in ORDER else len(ORDER)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a package that comes after the importer's."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if rank(b) > rank(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Module cycles (each found once, from its first module in sorted order)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def main() -> int:
    graph = imports()
    problems = upward(graph) + [" -> ".join(c) for c in cycles(graph)]
    print("\n".join(problems) or f"pipeline/: no upward import, no cycle ({' < '.join(ORDER)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
