"""The tiny random LLaMA of `make repro-check` (and of the tests): its shape, and the model written as a plain HF
folder."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.core.atomic import atomic_path
from pipeline.data.tokenizer import load_tokenizer, save_tokenizer


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
