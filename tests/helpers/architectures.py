"""The architecture matrix: tiny random causal LMs written by transformers' own config and model classes, as a user
would write one, each chosen for a way a model differs from LLaMA (docs/models.md lists them)."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
HEADS = {"num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

# name: (config class, its arguments beyond the vocabulary, what it covers)
MATRIX = {
    "llama": ("LlamaConfig", {**SHAPE, **HEADS, "tie_word_embeddings": True}, "the reference: tied head"),
    "mistral": ("MistralConfig", {**SHAPE, **HEADS, "sliding_window": 16}, "sliding window, mistral tokenizer path"),
    "qwen2": ("Qwen2Config", {**SHAPE, **HEADS}, "biases on q, k, v"),
    "qwen3": ("Qwen3Config", {**SHAPE, **HEADS, "tie_word_embeddings": False}, "QK norms, untied head"),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**SHAPE, **HEADS, **MOE, "decoder_sparse_step": 1},
        "MoE: per-expert checkpoint tensors fused into the model's experts",
    ),
    "mixtral": (
        "MixtralConfig",
        {**SHAPE, **HEADS, "num_local_experts": 4, "num_experts_per_tok": 2},
        "MoE: w1/w2/w3 experts, another naming",
    ),
    "gemma2": (
        "Gemma2Config",
        {**SHAPE, **HEADS, "sliding_window": 16, "query_pre_attn_scalar": 8},
        "soft-capped attention and logits, sliding windows, eager attention",
    ),
    "gemma3": ("Gemma3TextConfig", {**SHAPE, **HEADS, "sliding_window": 16}, "QK norms, local/global layers"),
    "phi3": ("Phi3Config", {**SHAPE, "num_key_value_heads": 2, "max_position_embeddings": 256}, "fused qkv, gate_up"),
    "gpt_neox": (
        "GPTNeoXConfig",
        {**SHAPE, "max_position_embeddings": 256, "use_parallel_residual": True, "tie_word_embeddings": False},
        "parallel blocks, fused qkv with biases, LayerNorm, head named embed_out in checkpoints",
    ),
    "olmo2": ("Olmo2Config", {**SHAPE, **HEADS}, "QK norms on the whole projection, post-norms"),
}


def write(name: str, out: Path, tokenizer_dir: Path, *, seed: int = 0, changes: dict | None = None) -> Path:
    """A tiny random model of the architecture `name` (its config's arguments with `changes`) with the tokenizer of
    `tokenizer_dir`, saved by `save_pretrained` into `out` (the same bytes for the same seed)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, arguments, _ = MATRIX[name]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), **{**arguments, **(changes or {})})
    config.pad_token_id = config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms and biases too: a loader that skips one cannot pass
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
