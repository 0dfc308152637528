"""Synthetic DeepSpeed checkpoint tags, written with torch.save in the layout DeepSpeed's `save_checkpoint` gives
them (deepspeed/checkpoint/constants.py; what its zero_to_fp32.py reads), without launching DeepSpeed: the fp32
masters and Adam moments of a few LoRA tensors, partitioned over `world` ranks the way each ZeRO stage stores them.

- ZeRO-1/2: the group's parameters as one flat vector, padded to a multiple of 2 x world, split evenly: rank R's
  `single_partition_of_fp32_groups`; one `mp_rank_00_model_states.pt` with `param_shapes`.
- ZeRO-3: each parameter split into `world` equal pieces (the last padded), rank R's pieces concatenated in parameter
  order: its `fp32_flat_groups`; a `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VERSION = "0.19.8"
PARAMETERS = {  # engine names, as a PEFT LoRA model's parameters are named inside DeepSpeed
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": (4, 16),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": (16, 4),
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight": (4, 16),
    "base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight": (7, 4),  # odd: ZeRO-3 pads it
}
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {fp32, exp_avg, exp_avg_sq}}: random values, the second moment positive."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, shape in PARAMETERS.items():
        fp32, first, second = (torch.randn(shape, generator=generator) for _ in KINDS)
        values[name] = {"fp32": fp32, "exp_avg": first, "exp_avg_sq": second.abs()}
    return values


def ds_config(stage: int, world: int, bf16: bool = True) -> dict:
    return {
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


def write_tag(
    tag_dir: Path, values: dict, *, stage: int, world: int, step: int = 5, bf16: bool = True
) -> dict[str, list[Path]]:
    """A tag of `values` saved by `world` ranks under ZeRO-`stage` (1-3); the files written, by kind."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    config, prefix = ds_config(stage, world, bf16), "bf16_" if bf16 else ""
    shapes = [{name: list(v["fp32"].shape) for name, v in values.items()}]
    dtype = torch.bfloat16 if bf16 else torch.float32
    module = {name: v["fp32"].to(dtype) for name, v in values.items()}
    common = {"ds_config": config, "ds_version": VERSION}
    model = {**common, "param_shapes": shapes, "global_steps": step, "dp_world_size": world, "shared_params": {}}
    written: dict[str, list[Path]] = {"model": [], "optim": []}
    if stage == 3:
        parts = {kind: _zero3_parts(values, kind, world) for kind in KINDS}
    else:
        parts = {kind: _zero12_parts(values, kind, world) for kind in KINDS}
    for rank in range(world):
        moments = {"step": step, "exp_avg": parts["exp_avg"][rank], "exp_avg_sq": parts["exp_avg_sq"][rank]}
        inner = {"zero_stage": stage, "partition_count": world}
        if stage == 3:
            inner |= {"fp32_flat_groups": [parts["fp32"][rank]], "optimizer_state_dict": {"state": {0: moments}}}
            path = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            torch.save({**model, "module": {}}, path)
            written["model"].append(path)
        else:
            inner |= {
                "single_partition_of_fp32_groups": [parts["fp32"][rank]],
                "base_optimizer_state": {"state": {0: moments}},
            }
        path = tag_dir / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({**common, "optimizer_state_dict": inner}, path)
        written["optim"].append(path)
    if stage != 3:
        path = tag_dir / "mp_rank_00_model_states.pt"
        torch.save({**model, "module": module}, path)
        written["model"].append(path)
    return written


def _zero12_parts(values: dict, kind: str, world: int) -> list[torch.Tensor]:
    flat = torch.cat([v[kind].flatten() for v in values.values()])
    padded = math.ceil(flat.numel() / (2 * world)) * 2 * world
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    return [piece.clone() for piece in flat.chunk(world)]


def _zero3_parts(values: dict, kind: str, world: int) -> list[torch.Tensor]:
    pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for v in values.values():
        flat = v[kind].flatten()
        size = math.ceil(flat.numel() / world)
        flat = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
        for rank in range(world):
            pieces[rank].append(flat[rank * size : (rank + 1) * size])
    return [torch.cat(rank_pieces).clone() for rank_pieces in pieces]


def write_run(checkpoint_dir: Path, values: dict, *, stage: int, world: int, steps: list[int]) -> None:
    """Our train stage's folder: a tag per step (`step_N`, with its trainer state), `latest` naming the last."""
    for step in steps:
        tag = checkpoint_dir / f"step_{step:06d}"
        write_tag(tag, values, stage=stage, world=world, step=step)
        state = {"step": step, "world_size": world, "zero_stage": stage, "fingerprint": "f"}
        (tag / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    (checkpoint_dir / "latest").write_text(f"step_{steps[-1]:06d}", encoding="utf-8")


def adapter_config(r: int = 4) -> dict:
    """The PEFT LoRA config of PARAMETERS."""
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 8,
        "target_modules": ["v_proj", "q_proj"],
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
    }
