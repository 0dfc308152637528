"""Whether a model folder could only load by running Python files of its own, read from its config.json alone: the
check stage asks it before any model code is imported."""

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
