"""A universal checkpoint -> a checkpoint folder of `world_size` ranks under ZeRO 1-3, which a run of that layout
resumes as its own (`python -m pipeline convert UNIVERSAL OUT --to zero`). DeepSpeed partitions a checkpoint only
inside an engine, so that many CPU ranks each build the engine a run of the target layout builds (the LoRA model's
skeleton from the base's config and the checkpoint's adapter config: the frozen base weights are not in a
checkpoint and are never read; the source run's optimizer settings), place the universal checkpoint into it, and
save it as a regular checkpoint of that layout (no optimizer step is taken)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch

from pipeline.checkpoints import adapter as adapter_format
from pipeline.checkpoints import folder, safe_pickle
from pipeline.checkpoints.universal import MANIFEST, is_universal, load_universal, refuse_existing
from pipeline.core.atomic import atomic_path, read_json
from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.ops import before_launch, remove_stale_shm_buffers
from pipeline.launching.ranks import leave_process_group
from pipeline.training import ds_config as dsc


def to_zero(
    *, universal: Path, out_dir: Path, base: Path, world_size: int, zero_stage: int, port: int | None = None
) -> None:
    """Write `out_dir` (`latest` + tag) from `universal` through `world_size` CPU ranks under ZeRO-`zero_stage`;
    each holds the trainable parameters, never the base's weights."""
    if not is_universal(universal):
        raise FileNotFoundError(f"{universal}: not a complete universal checkpoint ({MANIFEST} or zero/ missing)")
    refuse_existing(out_dir)
    if zero_stage not in (1, 2, 3) or world_size < 1:
        raise ValueError(
            f"--zero-stage/--world-size: expected a stage of 1-3 and >= 1 rank, got {zero_stage}/{world_size}"
        )
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"--base: {base}/config.json missing; expected the base model's HF folder")
    safe_pickle.check_folder(universal)  # before a rank starts (each reads its files through safe_pickle again)
    port = port or free_port()
    launcher = ["deepspeed", "--num_gpus", str(world_size), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    env = {**with_venv_path(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with atomic_path(out_dir) as tmp:
        arguments = ["--universal", universal, "--out", tmp, "--base", base, "--zero-stage", zero_stage]
        command = [*launcher, "--module", "pipeline.training.zero_writer", *map(str, arguments)]
        before_launch()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        remove_stale_shm_buffers()
        if done.returncode:
            raise RuntimeError(
                f"the conversion ranks failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )


def engine_config(source: dict, stage: int, world: int) -> dsc.EngineConfig:
    """The source run's DeepSpeed config for `world` ranks under ZeRO-`stage`: the same global batch (the
    accumulation re-split), optimizer and precision; no offload (the ranks run on the CPU)."""
    micro, global_batch = source["train_micro_batch_size_per_gpu"], source["train_batch_size"]
    if global_batch % (micro * world):
        raise ValueError(
            f"--world-size: the global batch {global_batch} is not a multiple of micro batch {micro} x {world} ranks"
        )
    optimizer = source["optimizer"]["params"]
    return dsc.EngineConfig(
        zero=dsc.ZeroSettings(stage=stage),
        precision=next((p for p in ("bf16", "fp16") if source.get(p, {}).get("enabled")), "fp32"),
        micro=micro,
        accumulation=global_batch // (micro * world),
        world_size=world,
        lr=optimizer["lr"],
        weight_decay=optimizer["weight_decay"],
        max_grad_norm=source.get("gradient_clipping", 0.0),
        adam_epsilon=optimizer.get("eps", dsc.ADAM_EPSILON),  # the default where a config leaves it out
        global_batch=global_batch,
    )


def write_rank(*, universal: Path, out: Path, base: Path, stage: int) -> None:
    """One rank: build the engine, place the universal checkpoint into it, save."""
    from pipeline.core import deepspeed_patches
    from pipeline.model.lora import LoraSpec, lora_skeleton, parameter_groups

    deepspeed = deepspeed_patches.imported()
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    state = read_json(universal / folder.STATE)
    adapter = read_json(universal / adapter_format.CONFIG)
    source = safe_pickle.load(next(universal.glob("*model_states.pt")))["ds_config"]
    identity = state["identity"]
    lora = LoraSpec(
        r=identity["lora_r"],
        alpha=adapter["lora_alpha"],
        dropout=adapter["lora_dropout"],
        use_rslora=adapter.get("use_rslora", False),
        target_modules=identity["target_modules"],
        modules_to_save=identity["modules_to_save"],
        use_dora=identity.get("use_dora", False),
    )
    lr_ratio = (state.get("variant") or {}).get("lr_ratio")  # LoRA+: the same groups as the run that wrote it
    config = engine_config(source, stage, world)
    model = lora_skeleton(base_dir=base, vocab_rows=identity["vocab_rows"], lora=lora, dtype=config.module_dtype)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(
            model,
            source["optimizer"]["params"]["weight_decay"],
            lr=source["optimizer"]["params"]["lr"],
            lr_ratio=lr_ratio,
        ),
        config=config.as_dict(),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    load_universal(engine, universal)
    folder.seed_rng(state["step"] * 1_009 + rank)
    state = {**state, "world_size": world, "zero_stage": stage}
    folder.save(engine=engine, directory=out, step=state["step"], state=state, tokenizer_dir=universal, keep_last=1)
    leave_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--universal", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--zero-stage", type=int, required=True)
    args = parser.parse_args()
    write_rank(universal=args.universal, out=args.out, base=args.base, stage=args.zero_stage)
