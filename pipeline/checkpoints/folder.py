"""A training run's checkpoint folder: which tag is complete, whether it belongs to this run, pruning, the per-rank
RNG state, and saving one (DeepSpeed's shards + adapter config + tokenizer + trainer state, `latest` last)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from pipeline.checkpoints.universal import universal_path
from pipeline.core.atomic import atomic_path, read_json
from pipeline.data.tokenizer import FILES as TOKENIZER_FILES

LATEST = "latest"
STATE = "trainer_state.json"
TAG_PATTERN = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def file_digest(paths: list[Path]) -> str:
    """sha256 over the bytes of `paths` (files, or every file below a folder, in sorted order)."""
    digest = hashlib.sha256()
    for path in paths:
        for item in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if item.is_file():
                digest.update(item.name.encode())
                digest.update(item.read_bytes())
    return digest.hexdigest()


def fingerprint(inputs: dict[str, str], settings: dict) -> str:
    """What fixes a training trajectory: input digests and the settings (not the world size or ZeRO stage)."""
    return hashlib.sha256(json.dumps({"inputs": inputs, "settings": settings}, sort_keys=True).encode()).hexdigest()


def latest_tag(checkpoint_dir: Path) -> str | None:
    """The tag `latest` points at, or None when there is no checkpoint yet."""
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text(encoding="utf-8").strip()
    if not (checkpoint_dir / tag / STATE).is_file():
        raise ValueError(f"{pointer}: points at '{tag}', which is not a complete checkpoint ({STATE} missing)")
    return tag


def read_state(checkpoint_dir: Path, tag: str) -> dict:
    return read_json(checkpoint_dir / tag / STATE)


IDENTITY_DEFAULTS = {"use_dora": False}  # what checkpoints written before a key existed mean by its absence


def check_same_rates(state: dict, source: Path, lr_ratio: float | None) -> None:
    """Refuse to resume under another LoRA+ ratio: the optimizer's groups and the schedule's base rates are restored
    from the checkpoint, so a new ratio would be ignored (or the groups would not fit)."""
    saved = (state.get("variant") or {}).get("lr_ratio")
    if saved != lr_ratio:
        raise ValueError(
            f"lora.lr_ratio: {source} was trained with lr_ratio {saved}, this run has {lr_ratio}; its optimizer "
            f"groups and rates are restored with it: expected lora.lr_ratio={'null' if saved is None else saved}"
        )


def check_same_model(state: dict, source: Path, identity: dict) -> None:
    """Refuse a checkpoint of another model (base, vocabulary, LoRA rank, targets, modules_to_save, DoRA)."""
    saved = {**IDENTITY_DEFAULTS, **state["identity"]}
    differs = {k: (saved.get(k), v) for k, v in identity.items() if saved.get(k) != v}
    if differs:
        detail = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differs.items())
        raise ValueError(f"train.resume_from: {source} is a checkpoint of another model ({detail})")


def layout(state: dict) -> tuple[int, int]:
    """(world size, ZeRO stage) a checkpoint was written under."""
    return state["world_size"], state["zero_stage"]


def point_latest(checkpoint_dir: Path, tag: str) -> None:
    """Make `tag` the checkpoint a resume picks (the last write of a save)."""
    with atomic_path(checkpoint_dir / LATEST) as tmp:
        tmp.write_text(tag, encoding="utf-8")


def prune(checkpoint_dir: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` step_* checkpoints (with their universal forms); never the one `latest`
    names."""
    current = latest_tag(checkpoint_dir)
    tags = sorted((p.name for p in checkpoint_dir.iterdir() if TAG_PATTERN.match(p.name)), reverse=True)
    removed = [t for t in tags[keep:] if t != current]
    for tag in removed:
        shutil.rmtree(checkpoint_dir / tag)
        shutil.rmtree(universal_path(checkpoint_dir / tag), ignore_errors=True)
    return removed


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rng(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_file(checkpoint_dir: Path, tag: str, rank: int) -> Path:
    return checkpoint_dir / tag / f"rng_state_rank{rank}.pt"


def save(*, engine, directory: Path, step: int, state: dict, tokenizer_dir: Path, keep_last: int) -> str:
    """DeepSpeed shards + adapter config + tokenizer + RNG; `latest` moves only when every rank is done."""
    import deepspeed.comm as dist

    tag, rank = tag_for(step), dist.get_rank()
    if rank == 0 and (directory / tag).exists():
        shutil.rmtree(directory / tag)  # a save interrupted earlier at this step
    dist.barrier()
    engine.save_checkpoint(str(directory), tag=tag, save_latest=False, exclude_frozen_parameters=True)
    torch.save(rng_state(), rng_file(directory, tag, rank))
    dist.barrier()
    if rank == 0:
        engine.module.peft_config["default"].save_pretrained(str(directory / tag))
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, directory / tag / name)
        (directory / tag / STATE).write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
        point_latest(directory, tag)
        prune(directory, keep_last)
    dist.barrier()
    return tag
