"""A long sequence trains on a CPU in memory that grows linearly with it: one step at 12,288 tokens, then at 49,152
(4x), in one process. Attention that kept its scores would need 49,152^2 x 4 bytes = 9.7 GB for one fp32 score matrix
of one head (eager attention keeps two per head and layer: more than this machine, or CI's, has); here the step adds
about 4x (not 16x) what the 4x shorter one added, and less than 256 MB: measured 53 and 138 MB with the CPU paths
and the tiled MLP, 116 and 465 MB without them (`--paths off`: the whole logits and the MLP's activations kept)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_memory_grows_linearly_with_the_sequence():
    short, long = 12_288, 49_152
    command = [sys.executable, "-m", "tests.helpers.long_sequence_worker", "--tokens", str(short), str(long)]
    environment = with_venv_path() | {"OMP_NUM_THREADS": "1"}  # one core: the same work whatever the machine
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    grown_short, grown_long = (peak - measured["before_mb"] for peak in measured["peaks_mb"])
    assert grown_short > 0, measured  # each step's own peak was seen (not one inherited from this process)
    assert grown_long < 256, f"{grown_long:.0f} MB for {long} tokens"
    assert long**2 * 4 / 2**20 > 9000  # what one head's fp32 scores alone would take, in MB
    assert grown_long < 6 * grown_short, (grown_short, grown_long)  # linear: about 4x; quadratic: 16x
