"""The proof of a GGUF export: read the file back with an independent reader (transformers' GGUF loading, which
de-quantizes and undoes the rotary row order) and compare its tokenizer and logits with the source folder's.

f16 stores each weight rounded to f16 and nothing else: the file must compute exactly what the source computes with
its 2-D weights rounded to f16 (tolerance: fp32 summation noise). q8_0 rounds each block of 32 weights to 8 bits
with one scale: its logits must stay within the stated tolerances of the source's."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.model.gguf_reading import read_once

PROBES = (
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "中国人民银行今天宣布，下调存款准备金率。",
    "def square(x):\n    return x ** 2  # ünïcödé 🙂",
)
# Limits: f16 against the f16-rounded source; q8_0 against the source (largest gap relative to the largest logit).
F16_MAX_ABS = 1e-4
Q8_MAX_RELATIVE, Q8_MAX_KL = 0.1, 1e-2


def _logits(model, batches: list[torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(input_ids=ids).logits[0].float() for ids in batches])


def roundtrip(*, model_dir: Path, gguf_file: Path, type_name: str) -> dict:
    """Figures of the comparison; a ValueError when the file is outside the limits of its type. The file's metadata
    is read once for its tokenizer and its model (`gguf_reading.read_once`)."""
    with read_once(hand_over_reader=True):
        return _roundtrip(model_dir=model_dir, gguf_file=gguf_file, type_name=type_name)


def _roundtrip(*, model_dir: Path, gguf_file: Path, type_name: str) -> dict:
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenizer import load_tokenizer

    source_tokenizer = load_tokenizer(model_dir)
    read_tokenizer = load_tokenizer(gguf_file.parent, gguf_file=gguf_file.name)
    batches = [source_tokenizer(text, return_tensors="pt").input_ids for text in PROBES]
    differing = [t for t, ids in zip(PROBES, batches, strict=True) if read_tokenizer(t).input_ids != ids[0].tolist()]
    if differing:
        raise ValueError(f"{gguf_file}: its tokenizer encodes {differing[0]!r} differently from {model_dir}'s")
    if read_tokenizer.chat_template != source_tokenizer.chat_template:
        raise ValueError(f"{gguf_file}: its chat template differs from {model_dir}'s")
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = _logits(source, batches)
    read = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    logits = _logits(read.eval(), batches)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum")
    figures = {
        "tokens": int(reference.shape[0]),
        "max_abs_logit_diff": float((logits - reference).abs().max()),
        "max_abs_logit": float(reference.abs().max()),
        "mean_kl": float(kl / reference.shape[0]),
        "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
    }
    if type_name == "f16":
        with torch.no_grad():
            for param in source.parameters():
                if param.dim() == 2:
                    param.copy_(param.half().float())
        figures["max_abs_diff_vs_f16_rounded"] = float((logits - _logits(source, batches)).abs().max())
        if figures["max_abs_diff_vs_f16_rounded"] > F16_MAX_ABS:
            raise ValueError(
                f"{gguf_file}: logits differ from the f16-rounded source by {figures['max_abs_diff_vs_f16_rounded']}"
                f" (limit {F16_MAX_ABS}); the export changed more than the rounding"
            )
    elif figures["max_abs_logit_diff"] > Q8_MAX_RELATIVE * figures["max_abs_logit"] or figures["mean_kl"] > Q8_MAX_KL:
        raise ValueError(
            f"{gguf_file}: q8_0 logits differ by {figures['max_abs_logit_diff']:.4g} (largest logit "
            f"{figures['max_abs_logit']:.4g}, limit {Q8_MAX_RELATIVE:.0%} of it), mean KL {figures['mean_kl']:.3g} "
            f"(limit {Q8_MAX_KL})"
        )
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}
