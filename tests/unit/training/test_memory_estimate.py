"""The plan-time memory estimate: docs/scaling.md's model from a model's shapes, against what was measured, and the
refusal of a run that cannot fit, naming what would."""

from __future__ import annotations

from dataclasses import replace

import pytest
from safetensors.torch import load_file

from pipeline.training.memory_estimate import Setting, Shapes, check_fits, per_rank, shapes

LLAMA_3B = Shapes(
    parameters=3_212_749_824, largest=128_256 * 3072, trainable=24_313_856, hidden=3072, layers=28, heads=24
)
LLAMA_8B_R16_ALL = Shapes(
    parameters=8_030_261_248, largest=128_256 * 4096, trainable=41_943_040, hidden=4096, layers=32, heads=32
)
LLAMA_70B = Shapes(
    parameters=70_553_706_496, largest=128_256 * 8192, trainable=207_093_760, hidden=8192, layers=80, heads=64
)
GPU = {"dtype_bytes": 2, "accelerator": "cuda", "offload_param": False, "offload_optimizer": False}


def test_the_shapes_come_from_the_files(tiny_base_dir):
    files = load_file(tiny_base_dir / "model.safetensors")
    got = shapes(base_dir=tiny_base_dir, vocab_rows=49_216, targets=["q_proj", "v_proj"], modules_to_save=[], r=4)
    hidden = files["model.embed_tokens.weight"].shape[1]
    assert got.parameters == sum(t.numel() for t in files.values()) + (49_216 - 49_152) * hidden
    q, v = files["model.layers.0.self_attn.q_proj.weight"].shape, files["model.layers.0.self_attn.v_proj.weight"].shape
    assert got.trainable == 2 * 4 * (sum(q) + sum(v)) and got.layers == 2 and got.hidden == hidden


def test_the_3b_scale_check_rank_is_estimated_within_5_percent_of_its_measured_peak():
    """make scale-check: 2 CPU ranks, ZeRO-3, bf16, 64-token micro-batches: 6.50 GB measured per rank."""
    setting = Setting(zero_stage=3, offload_param=False, offload_optimizer=False, world_size=2, dtype_bytes=2,
                      tokens=64, checkpointing=False, accelerator="cpu")  # fmt: skip
    assert per_rank(LLAMA_3B, setting)["device"] == pytest.approx(6.50e9, rel=0.05)


def test_a_70b_under_zero2_on_80gb_gpus_is_refused_naming_zero3():
    zero2 = Setting(zero_stage=2, world_size=8, tokens=4096, checkpointing=True, **GPU)
    refusal = (
        r"needs about 14\d\.\d GB of GPU memory a rank under ZeRO-2 .* expected deepspeed=zero3 \(about \d\d\.\d GB"
    )
    with pytest.raises(ValueError, match=refusal):
        check_fits(LLAMA_70B, zero2, device_bytes=80e9, host_bytes=1e12, ranks=8)
    zero3 = Setting(zero_stage=3, world_size=8, tokens=4096, checkpointing=True, **GPU)
    check_fits(LLAMA_70B, zero3, device_bytes=80e9, host_bytes=1e12, ranks=8)
    on_two = Setting(zero_stage=3, world_size=2, tokens=4096, checkpointing=True, **GPU)
    with pytest.raises(ValueError, match=r"expected deepspeed=zero3_offload"):  # parameters to the 1 TB of host
        check_fits(LLAMA_70B, on_two, device_bytes=80e9, host_bytes=1e12, ranks=2)


@pytest.mark.parametrize("checkpointing, measured_mib", [(False, 34_685.5), (True, 18_801.9)])
def test_the_8b_on_one_gpu_is_estimated_within_8_percent_of_its_measured_peak(checkpointing, measured_mib):
    """bench.gpu_train on an H200 (docs/gpu.md): ZeRO-2, bf16, one 4,096-token sequence; the allocator's peak
    (max_memory_allocated) plus the CUDA context the estimate counts."""
    setting = Setting(zero_stage=2, world_size=1, tokens=4096, checkpointing=checkpointing, **GPU)
    measured = measured_mib * 2**20 + 0.5e9
    assert per_rank(LLAMA_8B_R16_ALL, setting)["device"] == pytest.approx(measured, rel=0.08)


def test_eager_attention_counts_its_score_matrices():
    """Eager attention keeps every layer's scores (heads x tokens x tokens, fp32 and bf16): 8B at 4,096 tokens
    without checkpointing needs about 69 GB more than SDPA, which keeps none."""
    plain = Setting(zero_stage=2, world_size=1, tokens=4096, checkpointing=False, sequence=4096, **GPU)
    eager = replace(plain, eager_attention=True)
    extra = per_rank(LLAMA_8B_R16_ALL, eager)["device"] - per_rank(LLAMA_8B_R16_ALL, plain)["device"]
    assert extra == 4096 * 4096 * 32 * 6 * 32
    recomputed = replace(eager, checkpointing=True)
    assert per_rank(LLAMA_8B_R16_ALL, recomputed)["device"] < per_rank(LLAMA_8B_R16_ALL, eager)["device"] / 2


def test_auto_checkpointing_recomputes_only_what_the_card_needs():
    """`train.gradient_checkpointing: auto` on a GPU: 8B at 4,096 tokens (about 36 GB without checkpointing) keeps
    every layer's activations on an 80 GB card, recomputes some layers on a 40 GB one (the fewest that fit, each
    layer fewer needing more memory), nearly all on 24 GB (about 19 GB with every layer recomputed: what
    `train.gradient_checkpointing=true` asks for); the same estimate as checkpointing on when every layer recomputes."""
    from pipeline.training.memory_estimate import AUTO_MARGIN, checkpointing_choice

    setting = Setting(zero_stage=2, world_size=1, tokens=4096, checkpointing=False, **GPU)
    assert checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=80e9)[0] == 0
    some, offload, reason = checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=40e9)
    assert not offload
    assert 0 < some < 32 and reason.startswith(f"auto: {some} of 32 layers")
    need = [
        per_rank(LLAMA_8B_R16_ALL, replace(setting, checkpointing=True, checkpointed=k))["device"]
        for k in (some - 1, some)
    ]
    assert need[0] > AUTO_MARGIN * 40e9 >= need[1]
    assert 28 <= checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=24e9)[0] < 32
    assert checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=16e9)[0] == 32  # does not fit: all, refused
    every = replace(setting, checkpointing=True)
    assert per_rank(LLAMA_8B_R16_ALL, replace(every, checkpointed=32)) == per_rank(LLAMA_8B_R16_ALL, every)
    assert per_rank(LLAMA_8B_R16_ALL, every)["device"] < 24e9 * AUTO_MARGIN


def test_auto_checkpointing_offloads_the_layer_inputs_only_where_nothing_else_fits():
    """Long sequences on one 80 GB card (issue 46): at 32k tokens recomputing some layers fits, their inputs stay on
    the GPU; at 128k every layer's inputs alone are 34 GB, so `auto` keeps them in host memory (about 39 GB on the
    GPU, the 38.6 GB bench.long_context measured at 131,072 tokens on an H200)."""
    from pipeline.training.memory_estimate import AUTO_MARGIN, checkpointing_choice

    setting = Setting(zero_stage=2, world_size=1, tokens=32768, sequence=32768, checkpointing=False, **GPU)
    count, offload, reason = checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=80e9, may_tile=True)
    assert 0 < count < 32 and not offload, reason
    setting = replace(setting, tokens=131072, sequence=131072)
    count, offload, reason = checkpointing_choice(LLAMA_8B_R16_ALL, setting, device_bytes=80e9, may_tile=True)
    assert (count, offload) == (32, True) and reason.startswith("auto: offload (about 38.6 GB a rank"), reason
    chosen = replace(setting, checkpointing=True, checkpoint_offload=True, tiled_mlp=True)
    assert per_rank(LLAMA_8B_R16_ALL, chosen)["device"] <= AUTO_MARGIN * 80e9
    assert per_rank(LLAMA_8B_R16_ALL, replace(chosen, checkpoint_offload=False))["device"] > AUTO_MARGIN * 80e9
