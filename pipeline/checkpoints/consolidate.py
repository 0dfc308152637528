"""A DeepSpeed checkpoint (ZeRO 0-3, any world size, fp32/bf16/fp16 engine) -> a PEFT adapter folder, written one
tensor at a time with a manifest; nothing appears in the output folder unless every check passed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from pipeline.atomic import atomic_path
from pipeline.checkpoints import adapter, safetensors_stream
from pipeline.checkpoints.zero_shards import master_weights
from pipeline.precision import DTYPES
from pipeline.tokenizer import FILES as TOKENIZER_FILES

MANIFEST = "consolidate_manifest.json"


def resolve_tag(checkpoint_dir: Path, tag: str | None) -> str:
    """TAG when given, else the tag `latest` names; each must be a folder of the checkpoint."""
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir}: no such checkpoint folder")
    available = sorted(p.name for p in checkpoint_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if tag is None:
        pointer = checkpoint_dir / "latest"
        if not pointer.is_file():
            raise FileNotFoundError(f"{pointer}: missing; pass --tag (tags here: {available or 'none'})")
        tag = pointer.read_text(encoding="utf-8").strip()
    if not (checkpoint_dir / tag).is_dir():
        raise ValueError(f"{checkpoint_dir}: tag '{tag}' is not a checkpoint here (tags: {available or 'none'})")
    return tag


def find_adapter_config(checkpoint_dir: Path, tag: str, explicit: Path | None) -> dict:
    """The LoRA config: --adapter-config, else the tag folder's, else the checkpoint folder's."""
    candidates = [explicit] if explicit else [checkpoint_dir / tag / adapter.CONFIG, checkpoint_dir / adapter.CONFIG]
    for path in candidates:
        if path.is_file():
            return adapter.read_config(path)
    raise FileNotFoundError(
        f"{' or '.join(map(str, candidates))}: no LoRA adapter config; pass --adapter-config FILE "
        f"(written by LoraConfig.save_pretrained)"
    )


def consolidate(
    *,
    checkpoint_dir: Path,
    output_dir: Path,
    tag: str | None = None,
    adapter_config: Path | None = None,
    dtype: str = "fp32",
) -> dict:
    """Write OUTPUT_DIR as a PEFT adapter folder (+ manifest); nothing is written unless every check passes."""
    from importlib.metadata import version

    tag = resolve_tag(checkpoint_dir, tag)
    config = find_adapter_config(checkpoint_dir, tag, adapter_config)
    state, source = master_weights(checkpoint_dir / tag)
    names = {adapter.peft_key(name): name for name in state}
    if not any("lora_" in key for key in names):
        raise ValueError(f"{checkpoint_dir / tag}: no LoRA parameters among the trainable tensors {sorted(names)}")
    entries = [(key, tuple(state[names[key]][0]), DTYPES[dtype]) for key in sorted(names)]

    def produce(key: str) -> torch.Tensor:
        value = state[names[key]][1]()
        if not safetensors_stream.all_finite(value):
            raise ValueError(f"{checkpoint_dir / tag}: parameter {names[key]} holds NaN or Inf")
        return value.to(DTYPES[dtype])

    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        digests = safetensors_stream.write(tmp / adapter.WEIGHTS, entries, produce)
        manifest = {
            "source": {**source.__dict__, "checkpoint": str(checkpoint_dir), "deepspeed_here": version("deepspeed")},
            "dtype": dtype,
            "elements": sum(math.prod(shape) for _, shape, _ in entries),
            "tensors": {
                key: {"shape": list(shape), "dtype": str(kind).removeprefix("torch."), "sha256": digests[key]}
                for key, shape, kind in entries
            },
        }
        (tmp / adapter.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for extra in TOKENIZER_FILES:
            if (checkpoint_dir / tag / extra).is_file():
                shutil.copy2(checkpoint_dir / tag / extra, tmp / extra)
    return manifest
