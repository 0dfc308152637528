"""The DeepSpeed config made concrete for the machine: pinned offload on GPUs, lean ZeRO-3 gathers on CPU ranks,
hierarchical partitioning within the world."""

from __future__ import annotations

import pytest

from tests.conftest import REPO


def test_offloaded_states_are_pinned_on_gpus_and_gathers_lean_on_cpu_ranks():
    from pipeline.training.ds_config import ZeroSettings, build

    common = {"precision": "bf16", "micro": 1, "accumulation": 1, "world_size": 8, "lr": 1e-4, "weight_decay": 0.0}
    zero = ZeroSettings(stage=3, offload_optimizer=True, offload_param=True)
    for accelerator, pinned, lean in (("cuda", True, False), ("cpu", False, True)):
        section = build(zero=zero, max_grad_norm=1.0, accelerator=accelerator, **common)["zero_optimization"]
        assert section["offload_optimizer"] == section["offload_param"] == {"device": "cpu", "pin_memory": pinned}
        assert ("stage3_max_live_parameters" in section) == lean


def test_hierarchical_partitioning_is_set_for_zero3_within_the_world():
    from pipeline.core import config
    from pipeline.training.ds_config import ZeroSettings, build

    common = {"precision": "bf16", "micro": 1, "accumulation": 1, "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0}
    section = build(zero=ZeroSettings(stage=3, hpz_partition_size=8), world_size=16, accelerator="cuda", **common)
    assert section["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert (
        "zero_hpz_partition_size" not in build(zero=ZeroSettings(stage=3), world_size=16, **common)["zero_optimization"]
    )
    with pytest.raises(ValueError, match=r"deepspeed.hpz_partition_size: 8 does not divide the world size \(12\)"):
        build(zero=ZeroSettings(stage=3, hpz_partition_size=8), world_size=12, **common)
    with pytest.raises(ValueError, match="deepspeed.hpz_partition_size: needs deepspeed.stage=3, got stage=2"):
        config.Config(**config.compose(REPO / "conf", ["deepspeed.hpz_partition_size=8"]))


def test_a_sequence_parallel_config_says_its_batch_is_over_the_data_parallel_world():
    """4 ranks in groups of 2 sharing each sequence: the batch is micro x accumulation x 2, and the config carries the
    split, so that ZeRO-3's zero.Init (which DeepSpeed gives no mpu) divides the world as the engine does."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from pipeline.training.ds_config import ZeroSettings, build

    common = {"precision": "fp32", "micro": 2, "accumulation": 1, "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0}
    plain = build(zero=ZeroSettings(stage=3), world_size=4, **common)
    split = build(zero=ZeroSettings(stage=3), world_size=2, sequence_parallel=2, **common)
    assert "sequence_parallel_size" not in plain and split["sequence_parallel_size"] == 2
    assert split["zero_optimization"]["reduce_scatter"] is True  # the reduction Layout.gradient_scale corrects
    assert split["train_batch_size"] == 4
    import deepspeed.comm as dist

    world = {"get_rank": lambda: 0, "get_world_size": lambda group=None: 4}  # DeepSpeedConfig asks the world's size
    with pytest.MonkeyPatch.context() as patch:
        for name, value in world.items():
            patch.setattr(dist, name, value)
        assert DeepSpeedConfig(split).world_size == 2


def test_adams_epsilon_is_the_one_configured():
    """train.adam_epsilon reaches DeepSpeed's AdamW (1e-8, its default, unless set); zero or less is refused by name."""
    from pipeline.core import config
    from pipeline.training.ds_config import ZeroSettings, build

    common = {"precision": "fp32", "micro": 1, "accumulation": 1, "world_size": 2, "lr": 1e-4, "weight_decay": 0.0}
    composed = config.Config(**config.compose(REPO / "conf", ["train.adam_epsilon=1e-6"]))
    built = build(zero=ZeroSettings(stage=2), max_grad_norm=1.0, adam_epsilon=composed.train.adam_epsilon, **common)
    assert built["optimizer"]["params"]["eps"] == 1e-6
    assert build(zero=ZeroSettings(stage=2), max_grad_norm=1.0, **common)["optimizer"]["params"]["eps"] == 1e-8
    with pytest.raises(ValueError, match="adam_epsilon"):
        config.Config(**config.compose(REPO / "conf", ["train.adam_epsilon=0"]))
