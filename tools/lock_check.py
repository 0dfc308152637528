"""Whether dvc.lock records the pipeline as the checkout has it: for every stage of dvc.yaml, each dependency that is
not made by a stage (our code, the shipped task files, requirements-assets.txt) with the md5 dvc.lock holds for it,
and its params with the values params.yaml holds; without running or reading any stage output. A change to pipeline
code lands with the `make run` that records it (CI runs this as a test).

    python -m tools.lock_check      # prints each stale entry (exit 1 if any)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f"{f}/") or f.startswith(f"{path}/") for f in folders)


def stale(root: Path = REPO) -> list[str]:
    """One line per stage dependency whose recorded hash or value differs from the checkout's (or is missing)."""
    import yaml
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    lock = root / "dvc.lock"
    locked = yaml.safe_load(lock.read_text(encoding="utf-8"))["stages"] if lock.is_file() else {}
    found = []
    with Repo(str(root)) as repo:
        stages = list(repo.index.stages)
        made = [str(Path(out.fs_path).relative_to(root)) for stage in stages for out in stage.outs]
        for stage in stages:
            if stage.name not in locked:
                found.append(f"{stage.name}: not in dvc.lock")
                continue
            for dep in stage.deps:
                if isinstance(dep, ParamsDependency):
                    changed = dep.status().get(str(dep), {})
                    if isinstance(changed, str):  # no params recorded at all ("new"), or the file gone ("deleted")
                        changed = dict.fromkeys(dep.params or [str(dep)], changed)
                    found += [f"{stage.name}: params {key} {state}" for key, state in sorted(changed.items())]
                    continue
                path = str(Path(dep.fs_path).relative_to(root))
                if _inside(path, made):  # an upstream output (or a folder holding one): its stage's own hash
                    continue
                recorded = dep.hash_info.value if dep.hash_info else None
                if recorded is None:
                    found.append(f"{stage.name}: {path} is not in dvc.lock")
                elif dep.get_hash().value != recorded:
                    found.append(f"{stage.name}: {path} differs from dvc.lock (md5 {recorded})")
    return found


def main() -> int:
    found = stale()
    for line in found:
        print(line)
    print("dvc.lock is stale: `make run` records the pipeline as it is" if found else "dvc.lock is current")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
