"""Import the base model once into a plain HF safetensors folder (from a GGUF file or an HF folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pipeline.core.atomic import atomic_path
from pipeline.core.precision import DTYPES
from pipeline.data.tokenizer import load_tokenizer, save_tokenizer
from pipeline.model import outline

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
MODEL_FILES = ("config.json", "generation_config.json")


def import_base(*, source: Path, out_dir: Path, tokenizer_dir: Path, dtype: str, max_shard_size: str) -> dict:
    """Write `out_dir` (model + tokenizer) and `tokenizer_dir` (tokenizer only); return a short summary."""
    if not source.exists():
        raise FileNotFoundError(f"model.path: {source} does not exist; expected a .gguf file or an HF model folder")
    if source.suffix == ".gguf":
        model, tokenizer = _load_gguf(source)
    elif (source / "config.json").is_file():
        if reason := custom_code(source):
            raise ValueError(reason)
        model, tokenizer = None, load_tokenizer(source)
    else:
        raise ValueError(f"model.path: {source} is neither a .gguf file nor a folder with config.json")

    with atomic_path(out_dir) as tmp:
        if model is None:
            _link_hf_folder(source, tmp, dtype=DTYPES[dtype], max_shard_size=max_shard_size)
        else:
            model.to(DTYPES[dtype]).save_pretrained(tmp, max_shard_size=max_shard_size)
            expected = _probe(model)
            del model  # the reloaded copy need not sit beside it: one model in memory at a time
            _check_roundtrip(expected, tmp, DTYPES[dtype])
        save_tokenizer(tokenizer, tmp, source)
        config = _plain_config(tmp)
        outline.write(tmp)
    with atomic_path(tokenizer_dir) as tmp:
        save_tokenizer(tokenizer, tmp, source)
    return {
        "architecture": config.architectures[0],
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "max_position_embeddings": config.max_position_embeddings,
    }


def custom_code(folder: Path) -> str | None:
    """Why the model folder could only load by running Python files of its own (its config's `auto_map`, for a
    model type transformers does not implement), else None. We never pass trust_remote_code: where the type is one
    transformers implements, its own code is used and the `auto_map` is ignored."""
    import json

    from transformers import CONFIG_MAPPING

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    mapped = config.get("auto_map")
    if not mapped or config.get("model_type") in CONFIG_MAPPING:
        return None
    code = sorted({str(v) for v in mapped.values()}) if isinstance(mapped, dict) else [str(mapped)]
    return (
        f"model.path: {folder / 'config.json'} maps the model to code of its own ({', '.join(code)}), which this "
        f"project never runs (no trust_remote_code); expected a model type transformers implements, got "
        f"{config.get('model_type')!r}"
    )


def tiny_llama_config(*, vocab_size: int, **overrides):
    """The tests' LLaMA shape: hidden 32, 2 layers, 4 heads (2 KV), tied embeddings."""
    from transformers import LlamaConfig

    shape = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
    }  # fmt: skip
    return LlamaConfig(vocab_size=vocab_size, **{**shape, **overrides})


def write_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """A tiny random LLaMA (hidden 32, 2 layers, tied embeddings) with the tokenizer of `tokenizer_dir`, as a plain
    HF folder: the model of the tests and of `make repro-check` (the same bytes for the same seed)."""
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    config = tiny_llama_config(vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    with atomic_path(out_dir) as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp, tokenizer_dir)


def _load_gguf(path: Path):
    """De-quantize a GGUF file into a plain (serializable) model of the same architecture."""
    from transformers import AutoModelForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    buffers = dict(gguf_model.named_buffers())  # non-persistent ones (rotary inv_freq) are not in the state dict
    for name, buffer in plain.named_buffers():
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(attr, buffers[name], persistent=False)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    return plain.eval(), tokenizer


def _link_hf_folder(source: Path, dst: Path, *, dtype: torch.dtype, max_shard_size: str) -> None:
    """Hard-link (or copy) a safetensors HF folder; other weight formats are converted to safetensors."""
    from transformers import AutoModelForCausalLM

    weights = [p for pattern in WEIGHT_FILES for p in sorted(source.glob(pattern))]
    if not any(p.suffix == ".safetensors" for p in weights):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model.save_pretrained(dst, max_shard_size=max_shard_size)
        return
    dst.mkdir(parents=True)
    for path in weights + [source / name for name in MODEL_FILES if (source / name).is_file()]:
        try:
            os.link(path, dst / path.name)
        except OSError:
            shutil.copy2(path, dst / path.name)


PROBE = torch.arange(1, 17).unsqueeze(0)  # the tokens the roundtrip check runs


def _probe(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(PROBE).logits


def _check_roundtrip(expected: torch.Tensor, folder: Path, dtype: torch.dtype) -> None:
    """The saved folder, loaded in `dtype`, must compute what the in-memory model computed (`expected`: its logits
    on PROBE)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    torch.testing.assert_close(_probe(reloaded), expected, rtol=0, atol=0)


def _plain_config(folder: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None):
        raise ValueError(f"{folder}/config.json: still carries a quantization_config; expected a plain model")
    return config
