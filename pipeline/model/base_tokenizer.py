"""The base's tokenizer and context length alone, read from a GGUF file or an HF folder without its weights: what the
data stages need of the base, so that preparing data never converts or loads a model (prepare_base, which does,
copies this tokenizer). In a process made `imports.tokenizers_only`, without torch: about 120 MB and 3 s for
SmolLM2's GGUF, where transformers with torch took 450 MB for the tokenizer alone. The files are those of
AutoTokenizer with torch (`tests/unit/model/test_base_tokenizer.py`)."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.atomic import atomic_path, write_json
from pipeline.data.tokenizer import load_tokenizer, save_tokenizer
from pipeline.model.gguf_reading import without_torch
from pipeline.model.remote_code import custom_code, not_causal


def check_source(source: Path) -> None:
    """Refuse a base that is neither a .gguf file nor an HF folder, or that could only load by running its own code."""
    if not source.exists():
        raise FileNotFoundError(f"model.path: {source} does not exist; expected a .gguf file or an HF model folder")
    if source.suffix != ".gguf" and not (source / "config.json").is_file():
        raise ValueError(f"model.path: {source} is neither a .gguf file nor a folder with config.json")
    if source.suffix != ".gguf" and (reason := custom_code(source) or not_causal(source)):
        raise ValueError(reason)


def import_base_tokenizer(*, source: Path, out_dir: Path, context_file: Path) -> dict:
    """Write the base's tokenizer to `out_dir` and its context length (with its model type and vocabulary) to
    `context_file`; return those figures."""
    from transformers import AutoConfig

    check_source(source)
    folder, gguf = (source.parent, {"gguf_file": source.name}) if source.suffix == ".gguf" else (source, {})
    with without_torch():
        tokenizer = load_tokenizer(folder, **gguf)
        config = AutoConfig.from_pretrained(folder, **gguf)
    with atomic_path(out_dir) as tmp:
        save_tokenizer(tokenizer, tmp, source)
    context = {
        "model_type": config.model_type,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
    }
    write_json(context_file, context)
    return context
