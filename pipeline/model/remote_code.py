"""What a model folder's config.json alone says it cannot be trained as here: a model that could only load by running
Python files of its own, or one transformers cannot build as a causal LM (an encoder such as BERT). The check stage asks
before any model code is imported."""

from __future__ import annotations

import json
from pathlib import Path


def custom_code(folder: Path) -> str | None:
    """Why the model folder could only load by running Python files of its own (its config's `auto_map`, for a
    model type transformers does not implement), else None. We never pass trust_remote_code: where the type is one
    transformers implements, its own code is used and the `auto_map` is ignored. transformers (and torch with it) is
    imported only for a config that has an `auto_map`."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    mapped = config.get("auto_map")
    if not mapped:
        return None
    from transformers import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return None
    code = sorted({str(v) for v in mapped.values()}) if isinstance(mapped, dict) else [str(mapped)]
    return (
        f"model.path: {folder / 'config.json'} maps the model to code of its own ({', '.join(code)}), which this "
        f"project never runs (no trust_remote_code); expected a model type transformers implements, got "
        f"{config.get('model_type')!r}"
    )


def not_causal(folder: Path) -> str | None:
    """Why the model of `folder` is not one AutoModelForCausalLM builds (a model type transformers implements with
    no causal-LM class: BERT, T5's encoder...), else None."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING or kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return (
        f"model.path: {folder / 'config.json'} is a {kind!r} model ({', '.join(config.get('architectures') or [])}), "
        "which transformers cannot build as a causal language model; expected a decoder model that "
        "AutoModelForCausalLM loads (LLaMA, Qwen, Mistral, Gemma, ...)"
    )
