"""The data order is a pure function of the step: each epoch a seeded permutation, cut into global batches whose
size follows the world unless it is stated."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.schedule import global_batch, micro_batch
from tests.conftest import REPO


def test_each_epoch_is_the_seeded_permutation_cut_into_batches():
    n_rows, size, seed = 1_003, 10, 7
    for epoch in (0, 1):
        want = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        got = torch.cat(
            [
                global_batch(step, n_rows=n_rows, global_batch_size=size, seed=seed)
                for step in range(epoch * 100, (epoch + 1) * 100)
            ]
        )
        assert torch.equal(got.long(), want[:1_000])  # the order every earlier run trained in; 3 rows dropped


def test_ranks_cover_the_global_batch_whatever_the_world_size():
    batch = global_batch(3, n_rows=64, global_batch_size=8, seed=1)
    for world, micro in ((1, 2), (2, 2), (4, 1), (8, 1)):
        covered = [
            row
            for index in range(8 // (world * micro))
            for rank in range(world)
            for row in micro_batch(batch, rank=rank, world_size=world, micro=micro, index=index)
        ]
        assert sorted(covered) == sorted(batch.tolist())


def test_an_auto_global_batch_grows_with_the_world_and_a_stated_one_is_checked():
    from pipeline.core import config
    from pipeline.training.ds_config import resolve_launch

    def launch(world: int, *overrides: str):
        cfg = config.Config(**config.compose(REPO / "conf", [f"launcher.ranks_per_node={world}", *overrides]))
        return resolve_launch(train=cfg.train, launcher=cfg.launcher)

    for world in (1, 2, 8, 16):  # the default: one row per rank and step
        got = launch(world, "launcher.accelerator=cpu")
        assert (got.global_batch_size, got.gradient_accumulation_steps) == (world, 1)
    got = launch(8, "launcher.accelerator=cpu", "train.gradient_accumulation_steps=4", "train.micro_batch_size=2")
    assert (got.global_batch_size, got.gradient_accumulation_steps) == (64, 4)
    got = launch(8, "launcher.accelerator=cpu", "train.global_batch_size=32")
    assert (got.global_batch_size, got.gradient_accumulation_steps) == (32, 4)
    with pytest.raises(ValueError, match=r"train.global_batch_size: 2 is not a multiple of .* world size \(8\)"):
        launch(8, "launcher.accelerator=cpu", "train.global_batch_size=2")
