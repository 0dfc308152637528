"""MFU's parts: the card's peak from its name, and LoRA's FLOPs per token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.training.figures import flops_per_token, peak_tflops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0),
        ("Tesla T4", None),
    ],
)  # fmt: skip
def test_the_peak_is_the_card_s(name, peak):
    assert peak_tflops(name) == peak


def test_lora_flops_leave_out_the_embedding_lookup_and_count_causal_attention():
    llama3_8b = SimpleNamespace(vocab_size=128_256, hidden_size=4096, num_hidden_layers=32, tie_word_embeddings=False)
    n = 8_030_261_248
    got = flops_per_token(n_params=n, model_config=llama3_8b, seq_len=4096)
    assert got == 4 * (n - 128_256 * 4096) + 6 * 32 * 4096 * 4096
    tied = SimpleNamespace(**{**vars(llama3_8b), "tie_word_embeddings": True})  # the head multiplies: all of N
    assert flops_per_token(n_params=n, model_config=tied, seq_len=4096) == 4 * n + 6 * 32 * 4096 * 4096
