"""`train.sequence_parallel` checked before a launch: the world it must divide, the data-parallel batch arithmetic,
the model's heads and attention; the memory estimate counting a rank's share of the sequence, the tiled MLP and the
offloaded checkpoints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.launching.settings import check_world
from pipeline.training.memory_estimate import Setting, Shapes, per_rank
from pipeline.training.sequence_parallel import check_model
from tests.conftest import REPO

LLAMA = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
LLAMA_8B = Shapes(parameters=8_030_261_248, largest=128_256 * 4096, trainable=41_943_040, hidden=4096, layers=32,
                  heads=32, intermediate=14_336, vocab=128_256)  # fmt: skip


def launch(world: int, *overrides: str):
    from pipeline.core import config
    from pipeline.launching.settings import resolve_launch

    cfg = config.Config(**config.compose(REPO / "conf", [f"launcher.ranks_per_node={world}", "launcher.accelerator=cpu",
                                                         *overrides]))  # fmt: skip
    return resolve_launch(train=cfg.train, launcher=cfg.launcher)


def test_the_global_batch_is_counted_over_the_data_parallel_groups():
    got = launch(4, "train.sequence_parallel=2", "train.global_batch_size=8")
    assert (got.data_world, got.gradient_accumulation_steps, got.global_batch_size) == (2, 4, 8)
    got = launch(4, "train.sequence_parallel=4")  # auto: one row per data-parallel group
    assert (got.data_world, got.global_batch_size) == (1, 1)
    with pytest.raises(ValueError, match=r"train.global_batch_size: 3 is not a multiple of .* data-parallel world "
                                         r"size \(2: the world over train.sequence_parallel 2\)"):  # fmt: skip
        launch(4, "train.sequence_parallel=2", "train.global_batch_size=3")
    with pytest.raises(ValueError, match=r"train.sequence_parallel: 3 does not divide the world size \(4 ranks\); "
                                         r"expected one of \[1, 2, 4\]"):  # fmt: skip
        launch(4, "train.sequence_parallel=3")


def test_what_cannot_be_split_is_named():
    check_model(8, config=LLAMA, attention="sdpa")  # 32 heads over 8 ranks, one key-value head each
    check_model(16, config=LLAMA, attention="flash_attention_2")  # each key-value head on 2 ranks
    check_model(1, config={**LLAMA, "sliding_window": 4096}, attention="eager")  # off: nothing to check
    refusals = {
        "the model's 32 attention heads do not split over 3 ranks": (3, LLAMA, "sdpa"),
        "the model's 6 key-value heads neither split over 4 ranks nor divide 4": (
            4, {**LLAMA, "num_key_value_heads": 6}, "sdpa"),
        "train.attention: eager with train.sequence_parallel 2": (2, LLAMA, "eager"),
        "has a sliding window": (2, {**LLAMA, "sliding_window": 4096}, "sdpa"),
        "or other layer kinds": (2, {**LLAMA, "layer_types": ["sliding_attention", "full_attention"]}, "sdpa"),
    }  # fmt: skip
    for message, (size, config, attention) in refusals.items():
        with pytest.raises(ValueError, match=message):
            check_model(size, config=config, attention=attention)
    check_model(2, config={**LLAMA, "sliding_window": 4096, "use_sliding_window": False}, attention="sdpa")
    with pytest.raises(ValueError, match="deepspeed.hpz_partition_size: 2 with train.sequence_parallel 2"):
        check_world(2, world_size=4, hpz_partition_size=2)


GPU = {"zero_stage": 2, "world_size": 1, "dtype_bytes": 2, "accelerator": "cuda", "offload_param": False,
       "offload_optimizer": False, "checkpointing": True}  # fmt: skip


def test_the_estimate_counts_the_long_sequence_paths():
    """8B at 128k tokens on one GPU: checkpointing keeps 34 GB of layer inputs (offloaded: in host memory instead);
    the recomputed layer's MLP activations shrink to one tile's; without the fused loss the logits alone are 134 GB;
    two sequence-parallel ranks hold half the tokens each."""
    long = Setting(tokens=131_072, **GPU)
    plain = per_rank(LLAMA_8B, long)
    offloaded = per_rank(LLAMA_8B, replace(long, checkpoint_offload=True))
    inputs = 131_072 * 4096 * 32 * 2
    assert plain["device"] - offloaded["device"] == pytest.approx(inputs)
    assert offloaded["host"] - plain["host"] == pytest.approx(inputs)
    tiled = per_rank(LLAMA_8B, replace(long, tiled_mlp=True))
    mlp = 131_072 * 4096 * (6 * 14_336 / 4096) - 3 * 4096 * 14_336 * 2  # the MLP's three, less one tile of them
    assert plain["device"] - tiled["device"] == pytest.approx(mlp)
    logits = per_rank(LLAMA_8B, replace(long, fused_loss=False))["device"] - plain["device"]
    assert logits == pytest.approx(131_072 * 128_256 * 10)
    half = per_rank(LLAMA_8B, replace(long, tokens=65_536, world_size=2))
    assert half["device"] < plain["device"] - inputs / 2


@pytest.mark.parametrize(("tokens", "measured_gb"), [(4096, 17.45), (32768, 21.99), (131072, 38.58)])
def test_the_8b_long_sequence_path_is_estimated_within_6_percent_of_its_measured_peak(tokens, measured_gb):
    """bench.long_context --gpu on an H200 (docs/long_context.md): one sequence, LoRA r=16 on every linear layer,
    bf16, the fused loss, the tiled MLP, checkpoints offloaded; max_memory_allocated plus the CUDA context."""
    setting = Setting(tokens=tokens, tiled_mlp=True, checkpoint_offload=True, **GPU)
    assert per_rank(LLAMA_8B, setting)["device"] == pytest.approx(measured_gb * 1e9 + 0.5e9, rel=0.06)


def test_the_long_context_experiment_passes_the_check_stage_and_a_split_smollm2_cannot_is_named():
    """experiment=long_context on the default model: 3 ranks share each 8,192-token sequence (SmolLM2-135M's 9
    heads, 3 key-value heads); 2 would not split its heads, which the check stage says before anything runs."""
    from pipeline.check import training_errors
    from pipeline.core import assets, config

    cfg = config.Config(**config.compose(REPO / "conf", ["experiment=long_context", "launcher.accelerator=cpu"]))
    assert (cfg.train.sequence_parallel, cfg.data.block_size, cfg.eval.context) == (3, 8192, 8192)
    source = assets.resolve(cfg.model.path)
    assert training_errors(cfg, source) == []
    split2 = ["experiment=long_context", "launcher.accelerator=cpu", "launcher.ranks_per_node=2",
              "train.sequence_parallel=2"]  # fmt: skip
    errors = training_errors(config.Config(**config.compose(REPO / "conf", split2)), source)
    assert errors == ["train.sequence_parallel: the model's 9 attention heads do not split over 2 ranks; expected a "
                      "divisor of 9"]  # fmt: skip
