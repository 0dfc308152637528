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
from tests.helpers.training import ONE_RANK, TINY, TWO_RANKS, env, train

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


def test_convert_to_universal_refuses_a_shard_that_runs_code(two_ranks_zero2, tmp_path):
    marker, out = tmp_path / "executed", tmp_path / "universal"
    target = crafted(two_ranks_zero2 / "checkpoints", tmp_path / "ckpt", "*optim_states.pt", marker)
    refused(pipeline_command("convert", tmp_path / "ckpt", out, "--to", "universal"), target, marker)
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


def pipeline_command(*arguments) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipeline", *map(str, arguments)]
    return subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)


def carries_a_command(target: Path, marker: Path) -> Path:
    """Rewrite the torch file `target` (a dict) with one object more, which runs `touch marker` when unpickled."""
    state = torch.load(target, weights_only=True)
    state["extra"] = RunsACommand(f"touch {marker}")
    torch.save(state, target)
    return target


@pytest.fixture(scope="module")
def universal_form(two_ranks_zero2, tmp_path_factory) -> Path:
    """The universal layout of the 2-rank ZeRO-2 run's last checkpoint (`convert --to universal`)."""
    out = tmp_path_factory.mktemp("universal") / "universal"
    done = pipeline_command("convert", two_ranks_zero2 / "checkpoints", out, "--to", "universal")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_convert_to_zero_refuses_a_universal_file_that_runs_code(universal_form, tiny_base_dir, tmp_path):
    """A universal checkpoint from elsewhere: every file of it is scanned before a rank reads one."""
    marker, universal, out = tmp_path / "executed", tmp_path / "universal", tmp_path / "zero"
    shutil.copytree(universal_form, universal)
    target = carries_a_command(next((universal / "zero").glob("*/exp_avg.pt")), marker)
    done = pipeline_command(
        "convert", universal, out, "--to", "zero", "--base", tiny_base_dir, "--world-size", 1, "--zero-stage", 2
    )
    refused(done, target, marker)
    assert not out.exists()


def test_resume_refuses_a_universal_form_beside_the_tag_that_runs_code(
    two_ranks_zero2, universal_form, inputs, tiny_base_dir, tmp_path
):
    """A received checkpoint folder with its tag's universal form beside it (what a conversion leaves): a run of
    another layout would load that form instead of converting, so it is scanned too."""
    marker, theirs = tmp_path / "executed", tmp_path / "theirs"
    shutil.copytree(two_ranks_zero2 / "checkpoints", theirs)
    tag = theirs / (theirs / "latest").read_text().strip()
    shutil.copytree(universal_form, tag.with_name(tag.name + "_universal"))
    target = carries_a_command(next(tag.with_name(tag.name + "_universal").glob("zero/*/fp32.pt")), marker)
    overrides = [*TINY, *ONE_RANK, "deepspeed=zero2", f"train.resume_from={theirs}"]
    refused(train(inputs, tiny_base_dir, tmp_path / "run", overrides, check=False), target, marker)
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before the run's folder was made"


def test_merge_refuses_a_bin_base_that_runs_code(tiny_base_dir, tmp_path):
    """A base in torch's .bin format: read with weights_only=True, so the object is never built."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    marker, base, adapter, out = tmp_path / "executed", tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    shutil.copytree(tiny_base_dir, base)
    weights = base / "model.safetensors"
    torch.save({**load_file(weights), "extra": RunsACommand(f"touch {marker}")}, base / "pytorch_model.bin")
    weights.unlink()
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(adapter)
    done = pipeline_command("merge", "--base", base, "--adapter", adapter, "--out", out)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output[-3000:]
    assert f"{base / 'pytorch_model.bin'}: not loadable with weights_only=True" in output, output[-3000:]
    assert "posix.system" in output and not marker.exists() and not out.exists()
