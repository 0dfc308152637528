"""What users point consolidate and convert at, from the other tools' side: our run folder, a DeepSpeed save_dir, an
HF Trainer output_dir of `checkpoint-N/` folders (the newest by N), a tag folder itself; folders with weights but no
DeepSpeed checkpoint are refused with what to do instead."""

from __future__ import annotations

import pytest

from pipeline.checkpoints.locate import locate
from tests.helpers.zero_files import tensors, write_run, write_tag


def test_our_run_folder_resolves_to_the_tag_latest_names(tmp_path):
    write_run(tmp_path / "checkpoints", tensors(), stage=2, world=2, steps=[3, 6])
    where = locate(tmp_path / "checkpoints")
    assert (where.checkpoint_dir, where.tag, where.notes) == (tmp_path / "checkpoints", "step_000006", ())
    assert locate(tmp_path / "checkpoints", "step_000003").tag_dir == tmp_path / "checkpoints" / "step_000003"
    with pytest.raises(ValueError, match=r"tag 'step_000009' is not a checkpoint here \(tags: \['step_000003'"):
        locate(tmp_path / "checkpoints", "step_000009")


def test_a_tag_folder_is_its_own_checkpoint(tmp_path):
    write_tag(tmp_path / "save" / "global_step40", tensors(), stage=3, world=2)
    where = locate(tmp_path / "save" / "global_step40")
    assert (where.checkpoint_dir, where.tag) == (tmp_path / "save", "global_step40")
    with pytest.raises(ValueError, match="is the checkpoint tag 'global_step40' itself; --tag global_step3"):
        locate(tmp_path / "save" / "global_step40", "global_step3")


def test_an_hf_trainer_output_dir_gives_its_newest_checkpoint_by_number(tmp_path):
    """checkpoint-10 is newer than checkpoint-9, though it sorts before it as text."""
    out = tmp_path / "output"
    for step in (9, 10):
        write_tag(out / f"checkpoint-{step}" / f"global_step{step}", tensors(), stage=2, world=1)
        (out / f"checkpoint-{step}" / "latest").write_text(f"global_step{step}")
    where = locate(out)
    assert (where.checkpoint_dir, where.tag) == (out / "checkpoint-10", "global_step10")
    assert where.notes == (f"{out}: picked checkpoint-10, the newest of 2 HF Trainer checkpoint folder(s) (by N)",)
    assert locate(out, "global_step9").checkpoint_dir == out / "checkpoint-9"


def test_a_missing_latest_is_refused_with_the_tags_there_not_guessed(tmp_path):
    write_tag(tmp_path / "save" / "global_step7", tensors(), stage=2, world=1)
    with pytest.raises(FileNotFoundError, match=r"latest: missing; pass --tag \(tags here: \['global_step7'\]\)"):
        locate(tmp_path / "save")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["adapter_model.safetensors", "adapter_config.json"], "holds a PEFT adapter .* but no DeepSpeed checkpoint"),
        (["config.json", "model.safetensors"], "holds a whole model .* but no DeepSpeed checkpoint"),
    ],
)
def test_a_folder_of_final_weights_is_refused_with_what_to_do(tmp_path, files, message):
    for name in files:
        (tmp_path / name).write_bytes(b"{}")
    with pytest.raises(ValueError, match=message):
        locate(tmp_path)
