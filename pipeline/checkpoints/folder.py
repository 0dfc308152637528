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

from pipeline.checkpoints.universal import universal_path
from pipeline.core.atomic import atomic_path, read_json
from pipeline.core.imports import torch
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


RNG_PARTS = ("python", "numpy", "torch", "cuda")
CUDA_RNG_BYTES = 16  # a CUDA generator's state: its seed and Philox offset, 8 bytes each (CUDAGeneratorImpl)


def read_rng_state(path: Path) -> dict:
    """A rank's RNG state file through the checkpoint loader, checked against what `rng_state` writes before any
    generator sees it: Python's (version 3, 624 uint32 words and a position, a cached gaussian or None), NumPy's
    MT19937 (a uint32 key of 624, a position, a flag and a float), torch's CPU generator state (uint8, its size),
    CUDA's (uint8 vectors)."""
    from pipeline.checkpoints import safe_pickle

    return check_rng_state(safe_pickle.load(path), path)


def check_rng_state(state: object, path: Path) -> dict:
    """`state` (loaded from `path`) if it is what `rng_state` writes, else a ValueError naming the file and the part."""
    problem = _rng_problem(state)
    if problem:
        raise ValueError(f"{path}: not an RNG state as the train stage saves it: {problem}")
    return state


def _rng_problem(state: object) -> str | None:
    """What makes `state` something other than `rng_state()`'s output, or None."""
    if type(state) is not dict or not {"python", "numpy", "torch"} <= set(state) <= {*RNG_PARTS}:
        return "expected a dict of python, numpy, torch (and cuda) states"
    python = state["python"]
    if type(python) is not tuple or len(python) != 3 or not _ints([python[0]], 3, 3) or type(python[1]) is not tuple:
        return "python: expected (3, a tuple of 625 ints, None or a float) as random.getstate() gives"
    if len(python[1]) != 625 or not _ints(python[1][:-1], 0, 2**32 - 1) or not _ints(python[1][-1:], 0, 624):
        return "python: expected 624 uint32 words and a position of at most 624"
    if python[2] is not None and type(python[2]) is not float:
        return "python: the cached gaussian must be a float or None"
    numpy = state["numpy"]
    if type(numpy) is not tuple or len(numpy) != 5 or type(numpy[0]) is not str or numpy[0] != "MT19937":
        return "numpy: expected ('MT19937', key, pos, has_gauss, cached_gaussian) as np.random.get_state() gives"
    key = numpy[1]
    if type(key) is not np.ndarray or key.dtype != np.uint32 or key.shape != (624,):
        return "numpy: the key must be a uint32 array of 624"
    if not _ints(numpy[2:3], 0, 624) or not _ints(numpy[3:4], 0, 1) or type(numpy[4]) is not float:
        return "numpy: expected a position in [0, 624], has_gauss 0 or 1 and a float"
    size = torch.get_rng_state().numel()
    if not _bytes_like(state["torch"], size):
        return f"torch: expected a contiguous uint8 tensor of {size} bytes"
    cuda = state.get("cuda", [])
    if type(cuda) is not list or not all(_bytes_like(s, CUDA_RNG_BYTES) for s in cuda):
        return f"cuda: expected a list of contiguous uint8 tensors of {CUDA_RNG_BYTES} bytes"
    return None


def _ints(values, low: int, high: int) -> bool:
    """Every value a Python int in [low, high]."""
    return all(type(v) is int and low <= v <= high for v in values)


def _bytes_like(value: object, size: int) -> bool:
    """A contiguous CPU uint8 vector of `size` bytes (a pickle can give a tensor any stride; generators refuse it)."""
    if type(value) is not torch.Tensor or value.dtype != torch.uint8 or value.dim() != 1 or value.device.type != "cpu":
        return False
    return value.numel() == size and value.is_contiguous()


def set_rng_state(state: dict) -> None:
    """Set the generators from a state `read_rng_state` checked."""
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
