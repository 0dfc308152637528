"""Which of our files each DVC stage runs: the import closure of its entry point (imports anywhere in a module, and
modules started by name, such as the train stage's `pipeline.training.rank`), with the C++ sources those modules
compile (a `NAME.cpp` they name, found in their package), against the code deps `dvc.yaml` lists.

    python -m tools.code_deps        # prints, per stage, what dvc.yaml misses or lists in excess (exit 1 if any)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages", "tools")
# Modules a stage imports that cannot change its outputs, so that editing them re-runs nothing.
NOT_DEPENDENCIES = {
    "stages/_common.py": "the stages' harness: argument parsing, the MLflow run, turning bad input into an exit",
    "pipeline/tracking/mlflow_run.py": "logging to MLflow",
    "pipeline/tracking/execution.py": "which MLflow run a process logs to",
    "pipeline/tracking/runs_view.py": "how the MLflow UI names and shows the runs",
    "pipeline/tracking/tensorboard.py": "logging the training curve for TensorBoard",
    "pipeline/core/errors.py": "printing bad input as one line and exiting",
    "pipeline/core/log.py": "printing progress lines (rank 0)",
    "pipeline/core/config.py": "checking params.yaml (the values themselves are the stages' `params`)",
    "pipeline/core/environment.py": "PATH and a free port for child processes",
    "pipeline/core/quiet.py": "silencing third-party warnings and progress bars",
}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of ours by dotted name (packages by their own name)."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, *, strings: bool = False) -> set[str]:
    """What `path` imports, anywhere in it (a `from M import N` gives M and M.N); with `strings`, every string
    constant too (a module started by name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def _referenced(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that `path` imports (anywhere) or names in a string (started by name)."""
    return {name for name in imported_names(path, strings=True) if name in known}


def holds_code(path: Path) -> bool:
    """Whether a module holds more than a docstring (package front pages do not)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return not all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def sources(path: Path) -> set[Path]:
    """The C++ files a module names (`"kernels.cpp"`), found in its package's folder."""
    named = {
        node.value
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".cpp")
    }
    return {found for name in named for found in path.parent.rglob(name)}


def closure(entry: str, root: Path = REPO) -> set[Path]:
    """Files `entry` runs, itself included: its modules (package __init__ files only where they hold code) and the
    C++ they compile; what a module of NOT_DEPENDENCIES imports is not followed."""
    known = modules(root)
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if str(known[name].relative_to(root)) not in NOT_DEPENDENCIES:
            todo.extend(_referenced(known[name], known))
    files = {known[name] for name in seen if known[name].name != "__init__.py" or holds_code(known[name])}
    return {path.relative_to(root) for path in files | {s for f in files for s in sources(f)}}


def _stages(root: Path) -> dict[str, dict]:
    """dvc.yaml's stages, a `foreach` stage by its `do` template."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    return {name: stage.get("do", stage) for name, stage in stages.items()}


def stage_entries(root: Path = REPO) -> dict[str, str]:
    """{stage: entry module} from the `python -m MODULE` of each stage's cmd in dvc.yaml."""
    return {name: re.search(r"python -m (\S+)", stage["cmd"])[1] for name, stage in _stages(root).items()}


def listed(root: Path = REPO) -> dict[str, set[Path]]:
    """{stage: the .py files of ours among its deps in dvc.yaml}."""
    stages = _stages(root)
    return {
        name: {Path(d) for d in stage.get("deps", []) if d.endswith((".py", ".cpp")) and d.split("/")[0] in PACKAGES}
        for name, stage in stages.items()
    }


def problems(root: Path = REPO) -> dict[str, dict[str, list[str]]]:
    """{stage: {"missing": [...], "extra": [...]}} for every stage whose code deps are wrong."""
    exempt = {Path(p) for p in NOT_DEPENDENCIES}
    deps, found = listed(root), {}
    for stage, entry in stage_entries(root).items():
        runs = closure(entry, root)
        missing = sorted(str(p) for p in runs - deps[stage] - exempt)
        extra = sorted(str(p) for p in deps[stage] - runs)
        if missing or extra:
            found[stage] = {"missing": missing, "extra": extra}
    return found


def main() -> int:
    found = problems()
    for stage, what in found.items():
        print(f"{stage}: missing {what['missing']}, not imported {what['extra']}")
    if not found:
        print("dvc.yaml lists every module each stage runs")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
