"""Training steps (forward and backward) of a tiny LoRA LLaMA on one sequence of each of `--tokens` lengths (in that
order), as a rank trains a long sequence on a CPU (the kernels, the tiled MLP); prints the resident memory (MB)
before the first step and each step's peak, for tests/integration/test_long_sequence_memory.py.

The peaks are VmHWM, reset before each step (tests/helpers/peak_memory.py)."""

from __future__ import annotations

import argparse
import json

import torch

from tests.helpers.peak_memory import reset_peak, status_mb


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--paths", choices=["on", "off"], default="on", help="off: kernels and the tiled MLP left out")
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from pipeline import kernels
    from pipeline.model import tiled_mlp
    from tools.tiny_model import tiny_llama_config

    torch.manual_seed(0)
    shape = {"hidden_size": 16, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
             "num_key_value_heads": 1, "tie_word_embeddings": False}  # fmt: skip
    shape["max_position_embeddings"] = max(args.tokens)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=512, **shape))
    model.config.use_cache = False
    model.set_attn_implementation("sdpa")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    if args.paths == "on":
        kernels.apply(model, device="cpu", zero_stage=0, enabled="auto")
        tiled_mlp.install(model)
    model.train()
    before, peaks = status_mb("VmRSS"), []
    for tokens in args.tokens:
        ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        reset_peak()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        peaks.append(status_mb("VmHWM"))
    print(json.dumps({"tokens": args.tokens, "before_mb": before, "peaks_mb": peaks}))


if __name__ == "__main__":
    main()
