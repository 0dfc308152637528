"""MFU's parts: the card's peak from its name, and LoRA's FLOPs per token; the steady throughput's warm-up."""

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


def test_steady_throughput_leaves_out_the_first_step_and_every_step_that_compiled():
    from pipeline.training.loop import Progress

    progress = Progress()
    progress.add_step(100, 4.0, compiled=True)  # CUDA starts, the first graphs
    progress.add_step(100, 0.5, compiled=False)
    progress.add_step(100, 3.0, compiled=True)  # a new width of DPO's pairs: its graphs
    assert progress.steady_tokens_per_s() is None  # no step after the warm-up yet
    progress.add_step(100, 0.5, compiled=False)
    progress.add_step(100, 0.5, compiled=False)
    assert progress.steady_tokens_per_s() == pytest.approx(200 / 1.0)
    assert progress.tokens == 500 and progress.train_seconds == pytest.approx(8.5)  # every step still counted


def test_a_resumed_segment_of_one_step_has_no_steady_throughput():
    from pipeline.training.loop import Progress

    progress = Progress.resumed({"step": 4, "history": {"train": [], "validation": []}, "tokens_seen": 400,
                                 "train_seconds": 9.0})  # fmt: skip
    progress.add_step(100, 0.5, compiled=False)
    assert progress.steady_tokens_per_s() is None
