"""Time a no-op `dvc repro` after a full run (target: under 3 s). Needs `make run` first."""

from __future__ import annotations

import subprocess

from bench.common import median_seconds, report

REPEATS = 5


def main() -> None:
    def repro() -> str:
        return subprocess.run(["dvc", "repro"], check=True, capture_output=True, text=True).stdout

    seconds, output = median_seconds(repro, REPEATS)
    if "Data and pipelines are up to date" not in output:
        raise SystemExit(f"dvc repro was not a no-op; run `make run` first:\n{output}")
    report("noop_repro", {"median_seconds": round(seconds, 3), "target_seconds": 3.0, "repeats": REPEATS})


if __name__ == "__main__":
    main()
