"""A model's outline: the paths of its modules, which of them are Linear layers, and which is the output head. It is
what LoRA's targets are checked and resolved against before the ranks load anything.

prepare_base writes it beside the weights (FILE, with the digest of the config it describes). The train stage reads it
instead of building the architecture on the meta device, which imports transformers' model code on the cores the ranks
import theirs on (figures: docs/training.md). A base without it (written by other means, or with a config edited since)
is outlined from its architecture."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.core.imports import torch

FILE = "module_outline.json"


@dataclass(frozen=True, kw_only=True)
class Outline:
    modules: tuple[str, ...]  # every module's path, the root ("") excluded
    linear: tuple[str, ...]  # the paths of the Linear layers (quantized ones included: they subclass it)
    head: str | None  # the output head's path


def of_model(model: torch.nn.Module) -> Outline:
    """The outline of a built model (on any device, the meta device included)."""
    names = {id(module): name for name, module in model.named_modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return Outline(
        modules=tuple(name for name in names.values() if name),
        linear=tuple(name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)),
        head=None if head is None else names[id(head)],
    )


def _config_digest(base_dir: Path) -> str:
    return hashlib.sha256((base_dir / "config.json").read_bytes()).hexdigest()


def meta_model(source: Path) -> torch.nn.Module:
    """The architecture without weights, on the meta device, from a model folder's config or a GGUF file's header
    (read as transformers reads it: prepare_base imports that file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(source)
    if source.suffix == ".gguf":
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    else:
        config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write(base_dir: Path) -> None:
    """Write the outline of the model whose config is `base_dir/config.json` into `base_dir`."""
    outline = of_model(meta_model(base_dir))
    with atomic_path(base_dir / FILE) as tmp:
        tmp.write_text(json.dumps({"config_sha256": _config_digest(base_dir), **asdict(outline)}))


def read(base_dir: Path) -> Outline:
    """The outline written for `base_dir`'s config, else (none written, or written for another config) the one of
    its architecture."""
    try:
        written = json.loads((base_dir / FILE).read_text())
        if written.pop("config_sha256") == _config_digest(base_dir):
            return Outline(modules=tuple(written["modules"]), linear=tuple(written["linear"]), head=written["head"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return of_model(meta_model(base_dir))
