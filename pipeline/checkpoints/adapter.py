"""The PEFT adapter format: file names, the LoRA config, and tensor names as `save_pretrained` writes them
(`base_model.model.<module>.lora_A.weight`, modules_to_save as `base_model.model.<module>.weight`). Adapters other
trainers saved are read into that form: `adapter_model.safetensors` or `.bin`, names with or without the
`base_model.model.` prefix or with the adapter's name (`.default.`) left in."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.atomic import read_json

if TYPE_CHECKING:
    from pipeline.checkpoints.model_files import FileTensor

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
WEIGHTS_BIN = "adapter_model.bin"
VARIANT = "variant.json"  # ours: how the adapter was trained (DoRA, LoRA+, the base's quantization)
PREFIX = "base_model.model."  # every tensor name of a saved causal-LM adapter starts with it
MAGNITUDE = "lora_magnitude_vector"  # DoRA's trained magnitude, saved as `<module>.lora_magnitude_vector`


def read_config(path: Path) -> dict:
    """A LoRA adapter_config.json; `target_modules` sorted (PEFT keeps a set: its saved order varies per process)."""
    config = read_json(path)
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path}: peft_type is {found!r}, expected 'LORA'")
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def weights_file(adapter_dir: Path) -> Path:
    """The adapter's tensor file: adapter_model.safetensors, else adapter_model.bin."""
    for name in (WEIGHTS, WEIGHTS_BIN):
        if (adapter_dir / name).is_file():
            return adapter_dir / name
    raise FileNotFoundError(f"{adapter_dir / WEIGHTS}: missing (nor {WEIGHTS_BIN}); expected the adapter's tensors")


def read(adapter_dir: Path) -> tuple[dict, dict[str, FileTensor]]:
    """An adapter folder's config and tensors (not read yet), under PEFT's saved names."""
    config_path = adapter_dir / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; expected the adapter's LoRA config")
    return read_config(config_path), read_tensors(adapter_dir)[0]


def read_tensors(adapter_dir: Path) -> tuple[dict[str, FileTensor], bool]:
    """The adapter's tensors under PEFT's saved names, and whether the file already uses those names (then PEFT's
    own loader reads it as it is)."""
    from pipeline.checkpoints.model_files import tensors_of  # torch: not for the readers of the config alone

    path = weights_file(adapter_dir)
    found = tensors_of(path)
    tensors = canonical_names(found, path)
    return tensors, set(found) == set(tensors)


def peft_key(name: str, adapter: str = "default") -> str:
    """An engine parameter name as PEFT's save_pretrained writes it (no adapter name, no modules_to_save., DoRA's
    magnitude without its `.weight`)."""
    name = name.replace(f".{MAGNITUDE}.{adapter}.weight", f".{MAGNITUDE}")
    return name.replace(f"modules_to_save.{adapter}.", "").replace(f".{adapter}.", ".")


def read_variant(adapter_dir: Path) -> dict:
    """How the adapter was trained: variant.json (written by consolidate from our checkpoints), else what its
    config tells (DoRA or not; LoRA+ and the base's quantization unknown: None)."""
    if (adapter_dir / VARIANT).is_file():
        return read_json(adapter_dir / VARIANT)
    config = read_json(adapter_dir / CONFIG) if (adapter_dir / CONFIG).is_file() else {}
    return {"use_dora": bool(config.get("use_dora")), "lr_ratio": None, "quantization": None}


def describe_variant(variant: dict) -> str:
    """One line for tables and tags, e.g. "DoRA + LoRA+ x16 on an nf4 base (bf16 compute)"."""
    text = "DoRA" if variant.get("use_dora") else "LoRA"
    if variant.get("lr_ratio"):
        text += f" + LoRA+ x{variant['lr_ratio']:g}"
    kind = variant.get("quantization")
    if kind is None:
        return text + " (base precision unknown)"
    if kind != "none":
        text += f" on an {kind} base" + (f" ({variant['compute_dtype']} compute)" if kind == "nf4" else "")
    return text


def variant_tags(adapter_dir: Path) -> dict[str, str]:
    """What produced the adapter, from its variant.json (else its config), as run tags: `variant` in words, and
    `variant.dora`, `variant.lr_ratio`, `variant.quantization` (compute dtype with nf4) to filter runs by; none
    without an adapter."""
    if not (adapter_dir / CONFIG).is_file():
        return {}
    variant = read_variant(adapter_dir)
    tags = {
        "variant": describe_variant(variant),
        "variant.dora": str(bool(variant.get("use_dora"))).lower(),
        "variant.lr_ratio": "unknown" if variant.get("quantization") is None else str(variant.get("lr_ratio")),
        "variant.quantization": variant.get("quantization") or "unknown",
    }
    if variant.get("compute_dtype"):
        tags["variant.compute_dtype"] = variant["compute_dtype"]
    return tags


def canonical_names(tensors: dict[str, FileTensor], where: Path) -> dict[str, FileTensor]:
    """The tensors under PEFT's saved names; two names that become one must hold the same values."""
    out: dict[str, FileTensor] = {}
    for name, tensor in tensors.items():
        key = peft_key(name if name.startswith(PREFIX) else PREFIX + name)
        if key in out and out[key].digest() != tensor.digest():
            raise ValueError(f"{where}: two different tensors are both {key} once named as PEFT saves them")
        out.setdefault(key, tensor)
    return out


def pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for rank_pattern/alpha_pattern: the first pattern that matches the end of the module name wins."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _matches(module: str, targets) -> bool:
    """PEFT's target rule: a list names module suffixes, a string is a regular expression over the whole name."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets or [])


def check_config(config: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """The tensors (PEFT names -> shapes) are an adapter of this config: every LoRA module is a target with the
    config's rank (and with DoRA its magnitude), every other tensor belongs to a modules_to_save module. (A target
    that matches nothing is allowed, as PEFT allows it.)"""
    lora: dict[str, int] = {}
    magnitudes = set()
    for key, shape in shapes.items():
        name = key.removeprefix(PREFIX)
        if name.endswith(f".{MAGNITUDE}"):
            magnitudes.add(name.removesuffix(f".{MAGNITUDE}"))
        elif ".lora_A." in name:
            lora[name.split(".lora_A.")[0]] = shape[0]
        elif ".lora_B." not in name and not _matches(name.rsplit(".", 1)[0], config.get("modules_to_save") or []):
            raise ValueError(
                f"{where}: {key} is neither LoRA nor in modules_to_save {config.get('modules_to_save')} of the "
                f"adapter config (a config of another model or run?)"
            )
    dora = bool(config.get("use_dora"))
    if magnitudes != (set(lora) if dora else set()):
        odd = sorted(magnitudes ^ set(lora))[:3] if dora else sorted(magnitudes)[:3]
        raise ValueError(
            f"{where}: the adapter config has use_dora {str(dora).lower()} but the DoRA magnitudes "
            f"({MAGNITUDE}) do not match the LoRA modules: {odd}"
        )
    targets = config.get("target_modules")
    for module, rank in lora.items():
        if not _matches(module, targets):
            raise ValueError(f"{where}: LoRA module {module} is not among target_modules {targets} of the config")
        expected = pattern_value(config.get("rank_pattern") or {}, module, config.get("r"))
        if rank != expected:
            raise ValueError(f"{where}: LoRA module {module} has rank {rank}, the adapter config says {expected}")
