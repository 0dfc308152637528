"""`make test`'s pytest: the unit tier beside the integration tier, at low CPU priority (nice 10).

On CI's 2 cores the integration tier keeps them 74% busy: its launches, servers and daemons start, wait and join one
after another. The unit tier (about 7 minutes alone) takes that idle time instead of running after it; niced, it
gives way whenever the integration tier's ranks want both cores, so the integration tier's time-bounded steps keep
their margins. Each tier writes its own JUnit file and log (test-results/); the unit tier's output is printed after
the integration tier's; the exit status is non-zero when either tier failed.

    python -m tools.test_tiers [PYTEST ARGUMENTS...]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path("test-results")
TIERS = {"integration": "integration", "unit": "not integration"}  # tier: its marker expression
NICENESS = 10


def junit(tier: str) -> Path:
    return RESULTS / f"junit-{tier}.xml"


def pytest(tier: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", TIERS[tier], f"--junitxml={junit(tier)}", *extra]


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "junit.xml").unlink(missing_ok=True)  # a whole-suite run's file: not this run's
    log = RESULTS / "unit.log"
    with log.open("w", encoding="utf-8") as out:
        unit = subprocess.Popen(
            pytest("unit", extra), stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(NICENESS)
        )
        try:
            integration = subprocess.run(pytest("integration", extra)).returncode
        finally:
            unit_code = unit.wait()
    print(f"\n===== the unit tier (beside the integration tier, nice {NICENESS}; {log}) =====", flush=True)
    print(log.read_text(encoding="utf-8"), flush=True)
    failed = [tier for tier, code in (("integration", integration), ("unit", unit_code)) if code]
    print(f"test tiers: {', '.join(failed) + ' failed' if failed else 'both passed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
