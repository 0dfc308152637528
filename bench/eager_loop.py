"""The bare eager rate bench/train.py compares our loop with: one process, the base and a PEFT LoRA (r=8 on
q_proj,v_proj, PEFT's defaults) in the given precision, forward+backward of transformers' own loss on micro-batches of
our cached dataset, no optimizer, no DeepSpeed. Prints {"tokens_per_s": ...}: non-padding tokens over the seconds
of all the steps, the first included, as our loop's and LLaMA-Factory's rates are counted."""

from __future__ import annotations

import argparse
import json
import time

import torch

from pipeline.core import imports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--precision", choices=["bf16", "fp32"], required=True)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--offset", type=int, default=0, help="which micro-batches (one per process)")
    args = parser.parse_args()
    imports.without_unused()  # PEFT would import bitsandbytes, and it torch's compiler, for a base it does not quantize
    from datasets import load_from_disk
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.data.batches import collate

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained("artifacts/base", dtype=dtype)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, config).train()
    rows = load_from_disk(args.dataset)["train"].with_format("numpy")
    pad = model.config.pad_token_id or 0
    times, tokens = [], []
    for step in range(args.steps):
        start = (args.offset + step * 2) * args.micro
        batch = [rows[i] for i in range(start, start + args.micro)]
        inputs = collate(batch, pad)
        tick = time.perf_counter()
        model(**inputs).loss.backward()
        times.append(time.perf_counter() - tick)
        tokens.append(sum(len(r["input_ids"]) for r in batch))
    print(json.dumps({"tokens_per_s": sum(tokens) / sum(times)}))


if __name__ == "__main__":
    main()
