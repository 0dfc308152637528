"""A DeepSpeed checkpoint (ZeRO 0-3, any world size, fp32/bf16/fp16 engine, written by our train stage, HF Trainer,
LLaMA-Factory or a bare engine) -> a PEFT adapter folder, written one tensor at a time with a manifest; nothing
appears in the output folder unless every check passed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from pipeline.checkpoints import adapter, safetensors_stream
from pipeline.checkpoints.folder import STATE
from pipeline.checkpoints.locate import Located, locate
from pipeline.checkpoints.zero_shards import master_weights
from pipeline.core.atomic import atomic_path
from pipeline.core.precision import DTYPES, dtype_name
from pipeline.data.tokenizer import FILES as TOKENIZER_FILES

MANIFEST = "consolidate_manifest.json"
DEEPSPEED_CHAT_LORA = ("lora_right_weight", "lora_left_weight")  # its LinearLayer_LoRA: A^T and B^T


def find_adapter_config(where: Located, explicit: Path | None) -> tuple[dict, Path]:
    """The LoRA config and its file: --adapter-config, else the tag folder's, else the checkpoint folder's (an HF
    Trainer `checkpoint-N/` keeps it there)."""
    candidates = [explicit] if explicit else [where.tag_dir / adapter.CONFIG, where.checkpoint_dir / adapter.CONFIG]
    for path in candidates:
        if path.is_file():
            return adapter.read_config(path), path
    raise FileNotFoundError(
        f"{' or '.join(map(str, candidates))}: no LoRA adapter config; pass --adapter-config FILE "
        f"(written by LoraConfig.save_pretrained)"
    )


def trained_variant(where: Located) -> dict | None:
    """How our train stage trained this checkpoint (its trainer state's `variant`); None for other trainers'."""
    path = where.tag_dir / STATE
    state = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return state.get("variant") if isinstance(state, dict) else None


def consolidate(
    *,
    checkpoint_dir: Path,
    output_dir: Path,
    tag: str | None = None,
    adapter_config: Path | None = None,
    dtype: str = "fp32",
) -> dict:
    """Write OUTPUT_DIR as a PEFT adapter folder (+ manifest); nothing is written unless every check passes.
    CHECKPOINT_DIR may be any folder `locate` accepts."""
    from importlib.metadata import version

    where = locate(checkpoint_dir, tag)
    state, source, layout = master_weights(where.tag_dir)  # the files' checks first: nothing is read yet
    config, config_path = find_adapter_config(where, adapter_config)
    if chat := sorted(name for name in state if name.endswith(DEEPSPEED_CHAT_LORA)):
        raise ValueError(
            f"{where.tag_dir}: holds DeepSpeed-Chat's own LoRA layers ({chat[0]}, ...), not PEFT's, so there is no "
            f"PEFT adapter to write; fuse them with DeepSpeed-Chat's convert_lora_to_linear_layer and save the model "
            f"(save_hf_format), then evaluate that"
        )
    names = {adapter.peft_key(name): name for name in state}
    if not any("lora_" in key for key in names):
        raise ValueError(f"{where.tag_dir}: no LoRA parameters among the trainable tensors {sorted(names)}")
    shapes = {key: tuple(state[name][0]) for key, name in names.items()}
    tied = {adapter.peft_key(alias) for alias in layout.aliases}
    own = {key: shape for key, shape in shapes.items() if key not in tied}
    adapter.check_config(config, own, f"{where.tag_dir} with {config_path}")
    entries = [(key, shapes[key], DTYPES[dtype]) for key in sorted(names)]
    variant = trained_variant(where)

    def produce(key: str) -> torch.Tensor:
        value = state[names[key]][1]()
        if not safetensors_stream.all_finite(value):
            raise ValueError(f"{where.tag_dir}: parameter {names[key]} holds NaN or Inf")
        return value.to(DTYPES[dtype])

    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        digests = safetensors_stream.write(tmp / adapter.WEIGHTS, entries, produce)
        manifest = {
            "source": {
                **source.__dict__,
                "checkpoint": str(where.checkpoint_dir),
                "deepspeed_here": version("deepspeed"),
            },
            "layout": {"optimizer": layout.optimizer, "master_dtype": layout.master_dtype},
            "notes": [*where.notes, *layout.notes],
            "dtype": dtype,
            "variant": variant,
            "elements": sum(math.prod(shape) for _, shape, _ in entries),
            "tensors": {
                key: {"shape": list(shape), "dtype": dtype_name(kind), "sha256": digests[key]}
                for key, shape, kind in entries
            },
        }
        (tmp / adapter.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if variant is not None:
            (tmp / adapter.VARIANT).write_text(json.dumps(variant, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        folders = (where.tag_dir, where.checkpoint_dir)  # HF Trainer saves a tokenizer beside the tag
        tokenizer_dir = next((d for d in folders if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
        for extra in TOKENIZER_FILES if tokenizer_dir is not None else ():
            if (tokenizer_dir / extra).is_file():
                shutil.copy2(tokenizer_dir / extra, tmp / extra)
    return manifest
