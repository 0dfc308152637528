"""The data order is a pure function of the step: each epoch a seeded permutation, cut into global batches."""

from __future__ import annotations

import torch

from pipeline.training.schedule import global_batch, micro_batch


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
