"""Checkpoints from elsewhere are read as data: a file carrying an object whose unpickling runs a command is refused
by consolidate and by the train stage's resume, naming the file and the global, before anything runs or is written;
--trust-pickles lifts the check for a user's own files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.helpers.training import TINY, TWO_RANKS, env, train

pytestmark = pytest.mark.integration


class RunsACommand:
    """What a crafted checkpoint carries: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted(source: Path, folder: Path, file_pattern: str, marker: Path) -> Path:
    """A copy of the checkpoint folder `source` whose newest tag's `file_pattern` file carries one object more."""
    shutil.copytree(source, folder)
    tag = folder / (folder / "latest").read_text().strip()
    target = next(tag.glob(file_pattern))
    state = torch.load(target, weights_only=False)  # the test's own file
    state["extra"] = RunsACommand(f"touch {marker}")
    torch.save(state, target)
    return target


def refused(done: subprocess.CompletedProcess, target: Path, marker: Path) -> None:
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output[-3000:]
    assert f"{target}: refused: its pickle names posix.system" in output and "--trust-pickles" in output, output
    assert not marker.exists(), "nothing was executed"


@pytest.mark.parametrize("file_pattern", ["*optim_states.pt", "mp_rank_00_model_states.pt"])
def test_consolidate_refuses_a_shard_that_runs_code(two_ranks_zero2, tmp_path, file_pattern):
    marker, out = tmp_path / "executed", tmp_path / "adapter"
    target = crafted(two_ranks_zero2 / "checkpoints", tmp_path / "ckpt", file_pattern, marker)
    command = [sys.executable, "-m", "pipeline", "consolidate", str(tmp_path / "ckpt"), str(out)]
    refused(subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True), target, marker)
    assert not out.exists()


def test_trust_pickles_lifts_the_check_for_your_own_files(two_ranks_zero2, tmp_path):
    marker, out = tmp_path / "executed", tmp_path / "adapter"
    crafted(two_ranks_zero2 / "checkpoints", tmp_path / "ckpt", "*optim_states.pt", marker)
    command = [sys.executable, "-m", "pipeline", "consolidate", str(tmp_path / "ckpt"), str(out), "--trust-pickles"]
    done = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists() and (out / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("file_pattern", ["rng_state_rank1.pt", "*rank_1_mp_rank_00_optim_states.pt"])
def test_resume_refuses_a_checkpoint_that_runs_code(two_ranks_zero2, inputs, tiny_base_dir, tmp_path, file_pattern):
    """train.resume_from another run's folder: every file of its tag is scanned before DeepSpeed's loader reads one."""
    marker = tmp_path / "executed"
    target = crafted(two_ranks_zero2 / "checkpoints", tmp_path / "theirs", file_pattern, marker)
    overrides = [*TINY, *TWO_RANKS, "deepspeed=zero2", f"train.resume_from={tmp_path / 'theirs'}"]
    refused(train(inputs, tiny_base_dir, tmp_path / "run", overrides, check=False), target, marker)
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before the run's folder was made"
