"""A process's own memory figures from /proc/self/status, for the tests that measure a peak in a child process.

VmHWM, reset with /proc/self/clear_refs, never ru_maxrss: Linux carries ru_maxrss over exec, so a child started from
a test process larger than it (pytest late in a suite) reads that process's peak, and a growth measured as the
difference of two ru_maxrss readings is 0 whatever the child did."""

from __future__ import annotations

import re
from pathlib import Path


def status_mb(field: str) -> float:
    """A /proc/self/status memory figure (VmRSS: resident now; VmHWM: its peak since start or the last reset)."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) / 1024


def reset_peak() -> float:
    """VmHWM from here on counts from the resident memory now (Linux 4.0+); returns that memory (MB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_mb("VmRSS")
