"""Where the test suite's time goes, from a run's JUnit files (pytest writes test-results/junit.xml on every run;
`make test` writes unit.xml and integration.xml, one per tier): each file's tests and seconds, slowest first, with its
slowest tests. Both tiers run on a worker per core (pytest-xdist): their tests' seconds add up to more than their wall.

    python -m tools.test_times [test-results/junit.xml ...] [--top 5]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_times(*junits: Path) -> dict[str, list[tuple[float, str]]]:
    """{test file: [(seconds, test name), ...] slowest first} over the JUnit files `junits`; a test's seconds include
    its fixtures' setup."""
    found: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for case in (case for junit in junits for case in ET.parse(junit).getroot().iter("testcase")):
        module = case.get("classname", "").replace(".", "/") + ".py"
        found[module.removeprefix("tests/")].append((float(case.get("time", 0)), without_group(case.get("name", ""))))
    return {name: sorted(cases, reverse=True) for name, cases in found.items()}


def without_group(name: str) -> str:
    """A test's name less the worker group the integration tier gives it (`test_x[case]@group`, tests/conftest.py)."""
    head, at, group = name.rpartition("@")
    return head if at and "]" not in group else name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junits", nargs="*", type=Path, default=[Path("test-results/junit.xml")])
    parser.add_argument("--top", type=int, default=5, help="slowest tests shown per file")
    args = parser.parse_args(argv)
    for junit in args.junits:
        if not junit.is_file():
            raise SystemExit(f"{junit}: no JUnit file (pytest writes one on every run: test-results/junit.xml)")
    times = file_times(*args.junits)
    total = sum(s for cases in times.values() for s, _ in cases)
    print(f"{sum(map(len, times.values()))} tests, {total / 60:.1f} min in tests (fixtures included)")
    for name, cases in sorted(times.items(), key=lambda item: -sum(s for s, _ in item[1])):
        spent = sum(s for s, _ in cases)
        slowest = ", ".join(f"{test} {s:.0f}" for s, test in cases[: args.top])
        print(f"{name} ({len(cases)}, {spent / 60:.1f} min): {slowest}")


if __name__ == "__main__":
    main()
