"""Timing and reporting shared by the benchmarks."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path("bench/results")


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls, and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def report(name: str, figures: dict) -> None:
    """Print the figures and keep them in bench/results/NAME.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(f"== {name}")
    for key, value in figures.items():
        print(f"  {key:32s} {value}")
