"""The proof that a merged model computes what base + adapter computed: logits of both on fixed tokens."""

from __future__ import annotations

from pathlib import Path

import torch

TOLERANCES = {"fp32": (1e-3, 1e-6), "bf16": (1.0, 2e-2), "fp16": (0.25, 2e-3)}  # max |logit diff|, max mean KL


def logits_gap(*, base_dir: Path, adapter_dir: Path, merged_dir: Path, rows: int, seed: int = 0) -> dict:
    """Base + adapter (through PEFT) against the merged model on fixed token sequences, both in fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, rows, (2, 48), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if base.get_input_embeddings().weight.shape[0] != rows:
            base.resize_token_embeddings(rows, mean_resizing=False)
        expected = PeftModel.from_pretrained(base, str(adapter_dir)).eval()(input_ids=ids).logits.float()
        del base
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        got = merged(input_ids=ids).logits.float()
    log_p, log_q = expected.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return {"max_abs_logit_diff": float((expected - got).abs().max()), "mean_kl": float(kl), "tokens": ids.numel()}
