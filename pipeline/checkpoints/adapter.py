"""The PEFT adapter format: file names, the LoRA config, and tensor names as `save_pretrained` writes them."""

from __future__ import annotations

from pathlib import Path

from pipeline.atomic import read_json
from pipeline.checkpoints.safetensors_stream import Stored, stored

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # every tensor name of a saved causal-LM adapter starts with it


def read_config(path: Path) -> dict:
    """A LoRA adapter_config.json; `target_modules` sorted (PEFT keeps a set: its saved order varies per process)."""
    config = read_json(path)
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path}: peft_type is {found!r}, expected 'LORA'")
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def read(adapter_dir: Path) -> tuple[dict, dict[str, Stored]]:
    """An adapter folder's config and tensors (not read yet)."""
    config_path, weights_path = adapter_dir / CONFIG, adapter_dir / WEIGHTS
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; expected the adapter's LoRA config")
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: missing; expected the adapter's tensors")
    return read_config(config_path), stored(weights_path)


def peft_key(name: str, adapter: str = "default") -> str:
    """An engine parameter name as PEFT's save_pretrained writes it (no adapter name, no modules_to_save.)."""
    return name.replace(f"modules_to_save.{adapter}.", "").replace(f".{adapter}.", ".")
