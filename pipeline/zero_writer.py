"""One CPU rank of `python -m pipeline convert UNIVERSAL OUT --to zero`: DeepSpeed partitions a checkpoint only
inside an engine, so each rank builds the engine a run of the target layout builds (the LoRA model from the base
and the checkpoint's adapter config, the source run's optimizer settings), places the universal checkpoint into it,
and saves it as a regular checkpoint of that layout (no optimizer step is taken)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline import checkpoint as ckpt
from pipeline import ds_config as dsc
from pipeline.convert import load_universal
from pipeline.model import load_lora_model, parameter_groups
from pipeline.trainer import save_checkpoint


def engine_config(source: dict, stage: int, world: int) -> dict:
    """The source run's DeepSpeed config for `world` ranks under ZeRO-`stage`: the same global batch (the
    accumulation re-split), optimizer and precision; no offload (the ranks run on the CPU)."""
    micro, global_batch = source["train_micro_batch_size_per_gpu"], source["train_batch_size"]
    if global_batch % (micro * world):
        raise ValueError(
            f"--world-size: the global batch {global_batch} is not a multiple of micro batch {micro} x {world} ranks"
        )
    precision = next((p for p in ("bf16", "fp16") if source.get(p, {}).get("enabled")), "fp32")
    optimizer = source["optimizer"]["params"]
    return dsc.build(
        stage, False, False, False, True, precision, micro, global_batch // (micro * world), world,
        optimizer["lr"], optimizer["weight_decay"], source.get("gradient_clipping", 0.0), global_batch,
    )  # fmt: skip


def main(universal: Path, out: Path, base: Path, stage: int) -> None:
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    state = json.loads((universal / ckpt.STATE).read_text(encoding="utf-8"))
    adapter = json.loads((universal / "adapter_config.json").read_text(encoding="utf-8"))
    source = torch.load(next(universal.glob("*model_states.pt")), map_location="cpu", weights_only=False)["ds_config"]
    identity = state["identity"]
    model = load_lora_model(
        base, identity["vocab_rows"], "mean", identity["lora_r"], adapter["lora_alpha"], adapter["lora_dropout"],
        adapter.get("use_rslora", False), identity["target_modules"], identity["modules_to_save"], 0, False,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, source["optimizer"]["params"]["weight_decay"]),
        config=engine_config(source, stage, world),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    load_universal(engine, universal)
    ckpt.seed_rng(state["step"] * 1_009 + rank)
    save_checkpoint(engine, out, state["step"], {**state, "world_size": world, "zero_stage": stage}, universal, 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--universal", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--zero-stage", type=int, required=True)
    args = parser.parse_args()
    main(args.universal, args.out, args.base, args.zero_stage)
