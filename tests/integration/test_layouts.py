"""Checkpoint layouts: a 2-rank ZeRO-2 run stopped after step 3 resumes under 1 rank (ZeRO-2) and under 2 ranks
(ZeRO-3) through DeepSpeed's universal layout, and continues as the uninterrupted run did; the converter equals
DeepSpeed's ds_to_universal.py; bad input and interrupted conversions leave the source and every resume intact."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoints.universal import MANIFEST, is_universal, to_universal, universal_path
from pipeline.checkpoints.zero_shards import optimizer_state
from pipeline.core.atomic import read_json
from tests.conftest import REPO
from tests.helpers.training import ONE_RANK, TINY, TWO_RANKS, env, losses, train

pytestmark = pytest.mark.integration
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
KILLED = ".step_000003_universal.tmp-4242"  # the temporary folder of a conversion that was killed


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, two_ranks_zero2) -> Path:
    """The checkpoints of the 2-rank ZeRO-2 run as it left them after step 3 (step 6 not yet written), with what a
    conversion killed midway leaves beside them."""
    out = tmp_path_factory.mktemp("stopped") / "checkpoints"
    shutil.copytree(two_ranks_zero2 / "checkpoints", out, ignore=shutil.ignore_patterns("step_000006"))
    (out / "latest").write_text("step_000003")
    (out / KILLED / "zero" / "half.written").mkdir(parents=True)
    (out / KILLED / "zero" / "half.written" / "fp32.pt").write_bytes(b"partial")
    return out


def _resume(tmp_path: Path, stopped: Path, inputs, base, layout: list[str], check=True) -> subprocess.CompletedProcess:
    shutil.copytree(stopped, tmp_path / "checkpoints")
    extra = ("--loaded-state", str(tmp_path / "loaded.safetensors"))
    return train(inputs, base, tmp_path, [*TINY, *layout], check=check, extra=extra)


@pytest.mark.parametrize(
    "layout", [[*ONE_RANK, "deepspeed=zero2"], [*TWO_RANKS, "deepspeed=zero3"]], ids=["1rank_zero2", "2ranks_zero3"]
)
def test_resume_under_another_layout_continues_the_run(
    tmp_path, inputs, tiny_base_dir, two_ranks_zero2, stopped, layout
):
    done = _resume(tmp_path, stopped, inputs, tiny_base_dir, layout)
    checkpoints = tmp_path / "checkpoints"
    assert "was written by 2 rank(s) under ZeRO-2; converted it to DeepSpeed's universal layout" in done.stdout
    assert is_universal(universal_path(checkpoints / "step_000003")) and not (checkpoints / KILLED).exists()
    assert _tree(checkpoints / "step_000003") == _tree(stopped / "step_000003"), "the source is left as it was"

    states, _ = optimizer_state(stopped / "step_000003")  # the saved masters and moments, gathered from the shards
    loaded = load_file(tmp_path / "loaded.safetensors")  # as the new engine holds them before its first step
    assert len(loaded) == 3 * len(states)
    for name, kinds in states.items():
        for kind in KINDS:
            key = name if kind == "fp32" else f"{name}#{kind}"
            torch.testing.assert_close(loaded[key], kinds[kind][1](), rtol=0, atol=0, msg=key)

    resumed = read_json(tmp_path / "metrics.json")
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6
    whole = [line.split(",") for line in (two_ranks_zero2 / "curve.csv").read_text().splitlines()[1:]]
    again = [line.split(",") for line in (tmp_path / "curve.csv").read_text().splitlines()[1:]]
    assert [float(r[2]) for r in again] == pytest.approx([float(r[2]) for r in whole], rel=1e-6), "the LR schedule"
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(two_ranks_zero2)), atol=1e-5, rtol=0)
    expected, final = load_file(two_ranks_zero2 / "final.safetensors"), load_file(tmp_path / "final.safetensors")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    state = read_json(checkpoints / "step_000006" / "trainer_state.json")
    ranks = 1 if "launcher.ranks_per_node=1" in layout else 2
    assert (state["world_size"], state["zero_stage"]) == (ranks, 3 if "deepspeed=zero3" in layout else 2)


def test_converter_equals_deepspeeds_ds_to_universal(tmp_path, stopped):
    source = stopped / "step_000003"
    deepspeed = tmp_path / "deepspeed"
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
         "--output_folder", str(deepspeed), "--inject_missing_state"],
        check=True, capture_output=True, env=env(),
    )  # fmt: skip
    cli = [sys.executable, "-m", "pipeline", "convert", str(stopped), str(tmp_path / "ours"), "--to", "universal"]
    done = subprocess.run([*cli, "--workers", "2"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    manifest = read_json(tmp_path / "ours" / MANIFEST)
    assert manifest["step"] == 3 and manifest["source"]["world_size"] == 2
    for name in manifest["parameters"]:
        for kind in KINDS:
            ours = torch.load(tmp_path / "ours" / "zero" / name / f"{kind}.pt", weights_only=True)
            theirs = torch.load(deepspeed / "zero" / name / f"{kind}.pt", weights_only=False)
            torch.testing.assert_close(ours["param"], theirs["param"], rtol=0, atol=0, msg=f"{name} {kind}")
        step = torch.load(tmp_path / "ours" / "zero" / name / "step.pt", weights_only=True)
        assert float(step) == float(torch.load(deepspeed / "zero" / name / "step.pt", weights_only=False))
    to_universal(source, tmp_path / "one_worker", workers=1)
    assert _tree(tmp_path / "one_worker" / "zero") == _tree(tmp_path / "ours" / "zero"), "workers change nothing"

    again = subprocess.run([*cli], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 2 and "already exists; a conversion writes a new folder" in again.stderr


def test_layout_change_with_conversion_off_is_refused(tmp_path, inputs, tiny_base_dir, stopped):
    done = _resume(
        tmp_path,
        stopped,
        inputs,
        tiny_base_dir,
        [*ONE_RANK, "deepspeed=zero2", "train.convert_layout=false"],
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: train.convert_layout: " in done.stderr and "was written by 2 rank(s) under ZeRO-2" in done.stderr
    assert "expected train.convert_layout=true to convert it, or the checkpoint's layout" in done.stderr
    assert not universal_path(tmp_path / "checkpoints" / "step_000003").exists()


def test_another_models_checkpoint_is_refused_before_any_conversion(tmp_path, inputs, tiny_base_dir, stopped):
    other = [*ONE_RANK, "deepspeed=zero2", "lora.r=8", f"train.resume_from={stopped}"]
    done = train(inputs, tiny_base_dir, tmp_path, [*TINY, *other], check=False)
    assert done.returncode == 2, done.stderr
    assert "is a checkpoint of another model (lora_r: checkpoint 4, this run 8)" in done.stderr
    assert not universal_path(stopped / "step_000003").exists() and not (tmp_path / "checkpoints").exists()


def test_a_damaged_checkpoint_converts_to_nothing(tmp_path, stopped):
    source = tmp_path / "step_000003"
    shutil.copytree(stopped / "step_000003", source)
    shard = source / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match="cannot be read as a DeepSpeed shard"):
        to_universal(source, universal_path(source))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"], "nothing written, not even a temporary"


def convert_to_zero3(universal: Path, out: Path, base: Path) -> None:
    """`python -m pipeline convert --to zero` of a universal checkpoint into a 2-rank ZeRO-3 one, as a user runs it."""
    cli = [
        sys.executable, "-m", "pipeline", "convert", str(universal), str(out), "--to", "zero", "--world-size", "2",
        "--zero-stage", "3", "--base", str(base),
    ]  # fmt: skip
    done = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, env=env())
    assert done.returncode == 0, done.stderr[-3000:]


def test_offline_conversion_to_zero3_resumes_as_its_own(tmp_path, inputs, tiny_base_dir, two_ranks_zero2, stopped):
    universal = tmp_path / "universal"
    to_universal(stopped / "step_000003", universal)
    zero3 = tmp_path / "zero3_2ranks"
    convert_to_zero3(universal, zero3, tiny_base_dir)
    state = read_json(zero3 / "step_000003" / "trainer_state.json")
    assert (zero3 / "latest").read_text() == "step_000003" and (state["world_size"], state["zero_stage"]) == (2, 3)
    assert len(list((zero3 / "step_000003").glob("*_optim_states.pt"))) == 2

    run = tmp_path / "run"
    resumed = train(inputs, tiny_base_dir, run, [*TINY, *TWO_RANKS, "deepspeed=zero3", f"train.resume_from={zero3}"])
    assert f"resuming from {zero3 / 'step_000003'}" in resumed.stdout and "converted" not in resumed.stdout
    assert read_json(run / "metrics.json")["resumed_from_step"] == 3
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(two_ranks_zero2)), atol=1e-5, rtol=0)
    expected, final = load_file(two_ranks_zero2 / "final.safetensors"), load_file(run / "final.safetensors")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dora_loraplus_converted_offline_resume_as_the_uninterrupted_run(tmp_path, inputs, tiny_base_dir):
    """DoRA's magnitudes and LoRA+'s groups survive the offline conversion: the converter's engine is built with
    the variant the checkpoint was trained with (without it, the magnitudes were refused as foreign parameters)."""
    variants = ["lora.use_dora=true", "lora.lr_ratio=16", "lora.target_modules=all-linear"]
    whole = tmp_path / "whole"
    train(inputs, tiny_base_dir, whole, [*TINY, *TWO_RANKS, "deepspeed=zero2", *variants])
    universal, zero3 = tmp_path / "universal", tmp_path / "zero3"
    to_universal(whole / "checkpoints" / "step_000003", universal)
    convert_to_zero3(universal, zero3, tiny_base_dir)
    run = tmp_path / "run"
    train(inputs, tiny_base_dir, run, [*TINY, *TWO_RANKS, "deepspeed=zero3", f"train.resume_from={zero3}", *variants])
    assert read_json(run / "metrics.json")["resumed_from_step"] == 3
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(whole)), atol=1e-5, rtol=0)
    expected, final = load_file(whole / "final.safetensors"), load_file(run / "final.safetensors")
    assert sum("lora_magnitude_vector" in name for name in expected) == 14
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
