"""Time a no-op `dvc repro` after a full run (target: under 3 s). Needs `make run` first; the smoke mode times it
in a copy of the tiny pipeline's project instead (make test runs it).

    python -m bench.noop_repro
    python -m bench.noop_repro --smoke [--results DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import median_seconds, report, results_folder, smoke_arguments, smoke_project
from pipeline.core.environment import with_venv_path

REPEATS = 5


def measure(root: Path, repeats: int) -> dict:
    """The median seconds of `repeats` runs of `dvc repro` in `root`, each of which must find nothing to do."""

    def repro() -> str:
        done = subprocess.run(["dvc", "repro"], cwd=root, env=with_venv_path(), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"dvc repro failed in {root}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done.stdout

    seconds, output = median_seconds(repro, repeats)
    if "Data and pipelines are up to date" not in output:
        raise SystemExit(f"dvc repro was not a no-op in {root}; run `make run` first:\n{output}")
    return {"median_seconds": round(seconds, 3), "target_seconds": 3.0, "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("noop_repro", measure(Path("."), REPEATS), results)
        return
    with smoke_project(args.project) as project, tempfile.TemporaryDirectory(prefix="bench-noop-") as tmp:
        root = Path(tmp) / "project"  # a copy: a repro that is not a no-op must not change the given project
        shutil.copytree(project, root, symlinks=True)
        report("noop_repro", {**measure(root, 2), "smoke": True}, results)


if __name__ == "__main__":
    main()
