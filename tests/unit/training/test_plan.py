"""The plan a rank reads is the plan the stage wrote, typed again (the run state and the DeepSpeed config as frozen
dataclasses, not dicts), and the DeepSpeed config DeepSpeed receives is the one the typed choices build."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pipeline.launching.settings import Launch
from pipeline.model.lora import LoraSpec
from pipeline.training import plan
from pipeline.training.ds_config import EngineConfig, LayerSizes, ZeroSettings, build
from pipeline.training.preference import Objective
from pipeline.training.schedule import Schedule

CHOICES = {"precision": "bf16", "micro": 2, "accumulation": 3, "world_size": 4, "lr": 1e-4, "weight_decay": 0.1,
           "max_grad_norm": 1.0}  # fmt: skip


def a_plan(tmp_path: Path) -> plan.Plan:
    launch = Launch(accelerator="cpu", ranks_per_node=2, num_nodes=2, world_size=4, precision="bf16",
                    gradient_accumulation_steps=3, global_batch_size=24, gradient_checkpointing=False,
                    attention="sdpa", hosts=("node0", "node1"), join_timeout_s=60.0)  # fmt: skip
    identity = plan.Identity(base_config="abc", vocab_rows=600, lora_r=8, target_modules=["k_proj", "q_proj"],
                             modules_to_save=["embed_tokens", "lm_head"], use_dora=False)  # fmt: skip
    variant = plan.Variant(use_dora=False, lr_ratio=4.0, quantization="none", compute_dtype=None, load_dtype="bf16")
    state = plan.RunState(fingerprint="f" * 64, identity=identity, world_size=4, zero_stage=2,
                          launch={"world_size": 4}, variant=variant)  # fmt: skip
    paths = {n: tmp_path / n for n in ("base", "tokenizer", "dataset", "checkpoints", "metrics", "curve")}
    return plan.Plan(
        paths=plan.Paths(**paths, run_id_file=tmp_path / "run.json", final_state=tmp_path / "final.safetensors"),
        launch=launch,
        schedule=Schedule(
            micro_batch_size=2,
            accumulation=3,
            max_steps=9,
            warmup_steps=1,
            lr_scheduler="cosine",
            eval_every=3,
            eval_max_rows=0,
            save_every=3,
            keep_last=2,
            seed=7,
        ),  # fmt: skip
        lora=LoraSpec(
            r=8,
            alpha=16.0,
            dropout=0.0,
            use_rslora=False,
            target_modules=["k_proj", "q_proj"],
            modules_to_save=["embed_tokens", "lm_head"],
        ),  # fmt: skip
        optimizer=plan.Optimizer(lr=1e-4, weight_decay=0.1, lr_ratio=4.0),
        tracking=plan.Tracking(uri="sqlite:///mlruns.db", experiment="x", tensorboard=False),
        kernels="auto",
        kernels_skip=["zero_tail"],
        checkpointing="auto: 3 of 32 layers (about 30.1 GB a rank, 40.0 GB free)",
        checkpointed_layers=3,
        zero_stage=3,
        ds_config=EngineConfig(
            zero=ZeroSettings(stage=3), **CHOICES, global_batch=24, sizes=LayerSizes(largest_trained=65536, layer=10**8)
        ),
        run_state=state,
        pad_token_id=0,
        objective=Objective(kind="dpo", beta=0.1, simpo_gamma=0.5, reference="precomputed"),
        resume=plan.Resume(source=tmp_path / "checkpoints", finished=None),
    )


def test_the_plan_read_back_is_the_plan_written(tmp_path):
    written = a_plan(tmp_path)
    plan.write(written, tmp_path / plan.FILE)
    read = plan.read(tmp_path / plan.FILE)
    assert read == written
    assert isinstance(read.run_state.identity, plan.Identity) and isinstance(read.ds_config.zero, ZeroSettings)
    assert isinstance(read.ds_config.sizes, LayerSizes)
    assert read.ds_config.as_dict()["zero_optimization"]["stage3_param_persistence_threshold"] == 65537
    assert read.launch.hosts == ("node0", "node1") and read.paths.base == tmp_path / "base"
    saved = json.loads(json.dumps(read.run_state.saved()))  # as a checkpoint keeps it
    assert saved["identity"]["target_modules"] == ["k_proj", "q_proj"] and saved["variant"]["lr_ratio"] == 4.0
    assert set(saved) == {"fingerprint", "identity", "world_size", "zero_stage", "launch", "variant"}


def test_the_typed_deepspeed_config_builds_what_deepspeed_receives():
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        choices = {**CHOICES, "precision": precision}
        config = EngineConfig(zero=ZeroSettings(stage=3, offload_optimizer=True), **choices)
        assert config.as_dict() == build(zero=ZeroSettings(stage=3, offload_optimizer=True), **choices)
        assert config.module_dtype == dtype
    assert dataclasses.replace(config, world_size=8).as_dict()["train_batch_size"] == 2 * 3 * 8
    with pytest.raises(ValueError, match=r"train.global_batch_size: 5 != train.micro_batch_size \(2\)"):
        EngineConfig(zero=ZeroSettings(stage=2), **CHOICES, global_batch=5)  # refused when made, not when used
