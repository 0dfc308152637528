"""Each ZeRO stage's partitions, written as DeepSpeed writes them for 1-3 ranks, read back to every parameter's fp32
master and Adam moments exactly; files of one save that disagree, or a rank's file missing, are refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch

from pipeline.checkpoints.zero_shards import master_weights, optimizer_state
from tests.helpers.zero_files import PARAMETERS, tensors, write_tag


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masters_and_moments_are_the_saved_tensors(tmp_path, stage, world):
    values = tensors(seed=stage * 10 + world)
    write_tag(tmp_path / "global_step5", values, stage=stage, world=world, step=5)
    state, source, layout = master_weights(tmp_path / "global_step5")
    assert set(state) == set(PARAMETERS)
    for name, (shape, read) in state.items():
        assert tuple(shape) == PARAMETERS[name]
        torch.testing.assert_close(read(), values[name]["fp32"], rtol=0, atol=0)
    assert (source.zero_stage, source.world_size, source.step, source.optimizer_step) == (stage, world, 5, 5)
    assert layout.master_dtype == "float32" and layout.optimizer.startswith("DeepSpeedZeroOptimizer")
    moments, _ = optimizer_state(tmp_path / "global_step5")
    for name, kinds in moments.items():
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(kinds[kind][1](), values[name][kind], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_whose_optimizer_file_is_missing_is_named(tmp_path, stage):
    written = write_tag(tmp_path / "tag", tensors(), stage=stage, world=3)
    written["optim"][1].unlink()
    with pytest.raises(ValueError, match=r"world size 3 but optimizer shards for ranks \[0, 2\]; missing ranks \[1\]"):
        master_weights(tmp_path / "tag")


def test_zero3_without_a_rank_s_model_state_file_is_refused(tmp_path):
    written = write_tag(tmp_path / "tag", tensors(), stage=3, world=2)
    written["model"][1].unlink()
    with pytest.raises(ValueError, match=r"ZeRO-3 needs a model-state file per rank 0..1, found \[0\]"):
        master_weights(tmp_path / "tag")


def test_files_of_two_saves_under_one_tag_are_refused(tmp_path):
    """Rank 1's optimizer file from another run (another DeepSpeed config, then another step) beside rank 0's."""
    write_tag(tmp_path / "a", tensors(), stage=2, world=2, step=5)
    write_tag(tmp_path / "b", tensors(seed=1), stage=2, world=2, step=5, bf16=True)
    other = tmp_path / "b" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(other, weights_only=True)
    state["ds_config"]["train_batch_size"] = 8
    torch.save(state, tmp_path / "a" / other.name)
    with pytest.raises(ValueError, match=r"ds_config differs between .* in \['train_batch_size'\]"):
        master_weights(tmp_path / "a")
    write_tag(tmp_path / "c", tensors(), stage=2, world=2, step=6)
    shutil.copy(tmp_path / "c" / other.name, tmp_path / "a" / other.name)
    with pytest.raises(ValueError, match=r"files of different saves mixed under one tag \(optimizer step"):
        master_weights(tmp_path / "a")


def test_partitions_that_do_not_hold_the_recorded_parameters_are_refused(tmp_path):
    written = write_tag(tmp_path / "tag", tensors(), stage=2, world=2)
    model = torch.load(written["model"][0], weights_only=True)
    model["param_shapes"][0]["base_model.model.extra.lora_A.default.weight"] = [4, 64]
    torch.save(model, written["model"][0])
    with pytest.raises(ValueError, match=r"parameter group 0 holds 220 elements, its parameters 476"):
        master_weights(tmp_path / "tag")


def test_zero0_keeps_its_masters_in_the_model_state_file_and_has_no_partitions_to_convert(tmp_path):
    values = tensors()
    tag = tmp_path / "tag"
    tag.mkdir()
    module = {name: v["fp32"] for name, v in values.items()}
    torch.save(
        {"module": module, "ds_version": "0.19.8", "global_steps": 3, "dp_world_size": 2},
        tag / "mp_rank_00_model_states.pt",
    )
    state, source, _ = master_weights(tag)
    assert (source.zero_stage, source.world_size, source.step) == (0, 2, 3)
    for name, (_, read) in state.items():
        torch.testing.assert_close(read(), values[name]["fp32"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="a ZeRO-0 checkpoint keeps its optimizer whole"):
        optimizer_state(tag)
