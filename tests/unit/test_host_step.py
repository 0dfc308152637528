"""tools/host_step.py: ZeRO's host work per step on a CPU rank, each compared change switched in alternating blocks of
one engine (a process of its own: it starts torch.distributed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.core.environment import with_venv_path
from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("change", ["zero3_release", "aten_linear", "zero3_flags"])
def test_each_change_is_switched_between_the_blocks(change):
    command = [sys.executable, "-m", "tools.host_step", "--layers", "2", "--rounds", "2", "--steps", "1"]
    done = subprocess.run([*command, "--compare", change], cwd=REPO, env=with_venv_path(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["compare"] == change and figures["stage"] == 3
    assert all(len(figures["ms_a_step"][side]) == 2 for side in ("with", "without"))
    assert all(value > 0 for side in ("with", "without") for value in figures["ms_a_step"][side])
    # the replaced function ran only on the side without the change: every release or every product of the kernels
    # (several a step), or DeepSpeed's walk over the modules (once a step: 2 blocks of 1 step)
    assert figures["calls"]["with"] == 0, figures["calls"]
    if change == "zero3_flags":
        assert figures["calls"]["without"] == 2, figures["calls"]
    else:
        assert figures["calls"]["without"] >= 2 * 2, figures["calls"]


def test_a_comparison_that_needs_zero3_is_refused_by_name():
    command = [sys.executable, "-m", "tools.host_step", "--stage", "2", "--compare", "zero3_release"]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--compare zero3_release needs --stage 3" in done.stderr
    assert "Traceback" not in done.stderr
