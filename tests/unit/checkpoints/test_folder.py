"""A training run's checkpoint folder: `latest` names only complete tags, pruning keeps the newest and never the one
`latest` names, a resume is refused under another model or LoRA+ ratio by name, the fingerprint does not depend on
key order, and a rank's random streams come back as saved."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.checkpoints import folder
from pipeline.checkpoints.universal import universal_path
from tests.helpers.zero_files import tensors, write_run


def test_latest_names_a_complete_tag_or_nothing(tmp_path):
    assert folder.latest_tag(tmp_path) is None
    write_run(tmp_path, tensors(), stage=2, world=1, steps=[2])
    assert folder.latest_tag(tmp_path) == folder.tag_for(2) == "step_000002"
    (tmp_path / "step_000002" / folder.STATE).unlink()  # a save that did not finish
    with pytest.raises(ValueError, match=r"latest: points at 'step_000002', which is not a complete checkpoint"):
        folder.latest_tag(tmp_path)


def test_pruning_keeps_the_newest_with_their_universal_forms_and_never_latest(tmp_path):
    write_run(tmp_path, tensors(), stage=2, world=1, steps=[1, 2, 3, 4])
    universal_path(tmp_path / "step_000001").mkdir()
    folder.point_latest(tmp_path, "step_000002")  # a resume went back to step 2
    assert folder.prune(tmp_path, keep=2) == ["step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003", "step_000004"]


def test_a_checkpoint_of_another_model_or_ratio_is_refused_by_name(tmp_path):
    identity = {"base_config": "b", "vocab_rows": 600, "lora_r": 8, "target_modules": ["q_proj"], "use_dora": False}
    saved = {"identity": {k: v for k, v in identity.items() if k != "use_dora"}, "variant": {"lr_ratio": None}}
    folder.check_same_model(saved, tmp_path, identity)  # written before use_dora existed: absent means false
    with pytest.raises(ValueError, match=r"another model \(lora_r: checkpoint 8, this run 16\)"):
        folder.check_same_model(saved, tmp_path, {**identity, "lora_r": 16})
    folder.check_same_rates(saved, tmp_path, None)
    with pytest.raises(ValueError, match=r"trained with lr_ratio None, this run has 4.0.*expected lora.lr_ratio=null"):
        folder.check_same_rates(saved, tmp_path, 4.0)
    assert folder.layout({"world_size": 4, "zero_stage": 3}) == (4, 3)


def test_the_fingerprint_is_the_settings_not_their_order():
    a = folder.fingerprint({"dataset": "d1", "tokenizer": "t"}, {"train": {"lr": 1e-4, "seed": 1}})
    assert a == folder.fingerprint({"tokenizer": "t", "dataset": "d1"}, {"train": {"seed": 1, "lr": 1e-4}})
    assert a != folder.fingerprint({"dataset": "d2", "tokenizer": "t"}, {"train": {"lr": 1e-4, "seed": 1}})


def test_the_random_streams_resume_where_they_were_saved(tmp_path):
    folder.seed_rng(1234)
    saved = folder.rng_state()
    torch.save(saved, folder.rng_file(tmp_path, "", 0))
    first = (random.random(), np.random.rand(), torch.rand(3))
    folder.seed_rng(99)
    folder.set_rng_state(torch.load(folder.rng_file(tmp_path, "", 0), weights_only=False))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
