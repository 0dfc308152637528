"""Where the test suite's time goes, from a run's JUnit files: each file's tests and seconds, slowest first, with its
slowest tests. By default the latest run's: `make test`'s two tiers (test-results/junit-unit.xml and
junit-integration.xml, tools/test_tiers.py) or a plain `pytest`'s test-results/junit.xml, whichever is newer.

    python -m tools.test_times [JUNIT ...] [--top 5]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_times(*junits: Path) -> dict[str, list[tuple[float, str]]]:
    """{test file: [(seconds, test name), ...] slowest first}; a test's seconds include its fixtures' setup."""
    found: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for case in (case for junit in junits for case in ET.parse(junit).getroot().iter("testcase")):
        module = case.get("classname", "").replace(".", "/") + ".py"
        found[module.removeprefix("tests/")].append((float(case.get("time", 0)), case.get("name", "")))
    return {name: sorted(cases, reverse=True) for name, cases in found.items()}


def latest_run(results: Path = Path("test-results")) -> list[Path]:
    """The JUnit files of the latest run: both tiers' or the whole suite's, whichever is newer."""
    tiers = [results / "junit-integration.xml", results / "junit-unit.xml"]
    whole = results / "junit.xml"
    tiers = [p for p in tiers if p.is_file()]
    if whole.is_file() and (not tiers or whole.stat().st_mtime > max(p.stat().st_mtime for p in tiers)):
        return [whole]
    return tiers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", nargs="*", type=Path, help="JUnit files (default: the latest run's)")
    parser.add_argument("--top", type=int, default=5, help="slowest tests shown per file")
    args = parser.parse_args(argv)
    files = args.junit or latest_run()
    if not files or (missing := [p for p in files if not p.is_file()]):
        raise SystemExit(f"{missing if files else 'test-results/'}: no JUnit file (every pytest run writes one)")
    times = file_times(*files)
    total = sum(s for cases in times.values() for s, _ in cases)
    print(f"{sum(map(len, times.values()))} tests, {total / 60:.1f} min in tests (fixtures included)")
    for name, cases in sorted(times.items(), key=lambda item: -sum(s for s, _ in item[1])):
        spent = sum(s for s, _ in cases)
        slowest = ", ".join(f"{test} {s:.0f}" for s, test in cases[: args.top])
        print(f"{name} ({len(cases)}, {spent / 60:.1f} min): {slowest}")


if __name__ == "__main__":
    main()
