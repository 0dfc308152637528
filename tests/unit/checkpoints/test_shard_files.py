"""A tag's files told apart by DeepSpeed's names, one save or refused: two saves' files under one tag, a folder that
is no tag (or a universal checkpoint), parallelism this reader does not reassemble, a damaged shard."""

from __future__ import annotations

import shutil

import pytest

from pipeline.checkpoints.shard_files import load, tag_files
from tests.helpers.zero_files import tensors, write_tag


@pytest.mark.parametrize(("stage", "models"), [(2, [0]), (3, [0, 1, 2])])
def test_the_files_of_a_save_are_told_apart(tmp_path, stage, models):
    written = write_tag(tmp_path / "tag", tensors(), stage=stage, world=3)
    (tmp_path / "tag" / "adapter_config.json").write_text("{}")  # files beside the shards are not shards
    files = tag_files(tmp_path / "tag")
    assert sorted(files.model) == models and sorted(files.optim) == [0, 1, 2]
    assert sorted(files.model.values()) == sorted(written["model"]) and files.legacy == []


def test_shards_of_a_zero2_and_a_zero3_save_in_one_tag_are_refused(tmp_path):
    """The mix that makes DeepSpeed's own converter crash with a shape error (NOTES.md)."""
    write_tag(tmp_path / "tag", tensors(), stage=2, world=2)
    write_tag(tmp_path / "other", tensors(), stage=3, world=2)
    for path in (tmp_path / "other").glob("zero_pp_rank_*_model_states.pt"):
        shutil.copy(path, tmp_path / "tag" / path.name)
    with pytest.raises(ValueError, match=r"holds shard files of two saves \(model \(ZeRO 0-2, one file\)"):
        tag_files(tmp_path / "tag")


def test_what_is_not_a_data_parallel_tag_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*_model_states.pt file: not a DeepSpeed checkpoint tag"):
        tag_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such checkpoint tag folder"):
        tag_files(tmp_path / "absent")
    (tmp_path / "universal" / "zero").mkdir(parents=True)
    with pytest.raises(ValueError, match="a universal checkpoint"):
        tag_files(tmp_path / "universal")
    write_tag(tmp_path / "tp", tensors(), stage=2, world=1)
    shutil.copy(tmp_path / "tp" / "mp_rank_00_model_states.pt", tmp_path / "tp" / "mp_rank_01_model_states.pt")
    with pytest.raises(ValueError, match=r"tensor/model-parallel checkpoints \(mp_rank > 0\) are not supported"):
        tag_files(tmp_path / "tp")
    write_tag(tmp_path / "pp", tensors(), stage=2, world=1)
    (tmp_path / "pp" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="a pipeline-parallel or MoE checkpoint file"):
        tag_files(tmp_path / "pp")


def test_a_truncated_shard_is_named_not_a_traceback(tmp_path):
    written = write_tag(tmp_path / "tag", tensors(), stage=2, world=1)
    path = written["optim"][0]
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cannot be read as a DeepSpeed shard \(truncated or corrupted\?\)"):
        load(path)
    whole = load(written["model"][0])
    assert whole["global_steps"] == 5 and whole["module"].keys() == tensors().keys()
