"""A ZeRO tag converted to DeepSpeed's universal layout holds every parameter's fp32 master and Adam moments as
they were saved, under any stage and world size; a conversion never writes over a folder or inside its source, and
the universal form beside a tag is reused, not written twice."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.checkpoints.universal import MANIFEST, ensure_universal, is_universal, to_universal, universal_path
from tests.helpers.zero_files import PARAMETERS, tensors, write_tag


@pytest.mark.parametrize(("stage", "world"), [(2, 2), (3, 3), (1, 1)])
def test_every_parameter_s_master_and_moments_are_written_as_saved(tmp_path, stage, world):
    values = tensors(seed=world)
    write_tag(tmp_path / "global_step5", values, stage=stage, world=world, step=5)
    (tmp_path / "global_step5" / "trainer_state.json").write_text("{}")
    out = tmp_path / "universal"
    manifest = to_universal(tmp_path / "global_step5", out)
    assert is_universal(out) and json.loads((out / MANIFEST).read_text()) == manifest
    assert manifest["step"] == 5 and manifest["parameters"] == {n: list(s) for n, s in PARAMETERS.items()}
    assert (manifest["source"]["zero_stage"], manifest["source"]["world_size"]) == (stage, world)
    assert (out / "trainer_state.json").is_file(), "the trainer state travels with the universal form"
    for name in PARAMETERS:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            written = torch.load(out / "zero" / name / f"{kind}.pt", weights_only=True)
            torch.testing.assert_close(written["param"], values[name][kind], rtol=0, atol=0)
        assert float(torch.load(out / "zero" / name / "step.pt", weights_only=True)) == 5.0


def test_a_conversion_writes_a_new_folder_beside_its_source_once(tmp_path):
    tag = tmp_path / "step_000004"
    write_tag(tag, tensors(), stage=2, world=2, step=4)
    with pytest.raises(ValueError, match="inside the source checkpoint"):
        to_universal(tag, tag / "universal")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="already exists; a conversion writes a new folder and never over one"):
        to_universal(tag, tmp_path / "taken")
    out, manifest = ensure_universal(tag)
    assert out == universal_path(tag) == tmp_path / "step_000004_universal" and manifest["step"] == 4
    again, reused = ensure_universal(tag)
    assert again == out and reused is None
