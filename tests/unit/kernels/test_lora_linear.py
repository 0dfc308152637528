"""PEFT LoRA layers as one autograd function (pipeline/kernels/lora_linear.py): the loss and every trained gradient
within rounding of PEFT's (fp32, bf16; with LoRA's dropout, drawing the same masks; a trained head beside), nothing more
kept for the backward pass; DoRA, disabled and merged adapters run PEFT's own forward, bit for bit. On a GPU (marked
gpu) the same checks over nn.Linear."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.kernels import linear, lora_linear
from tests.helpers.lora_model import TARGETS, step, tiny_lora


@pytest.mark.parametrize(
    ("device", "frozen_linear"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.gpu)],
    ids=["nn_linear", "cpu_linear", "cuda"],
)
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_layers_train_as_peft(dtype, dropout, device, frozen_linear):
    """On a GPU over nn.Linear (the oneDNN layers are the CPU's), within the same rounding of PEFT's."""
    reference = tiny_lora(dtype, dropout=dropout, device=device)
    model = copy.deepcopy(reference)
    assert lora_linear.install(model) == 2 * len(TARGETS)
    if frozen_linear:
        linear.install(model)
    want, want_grads, want_kept = step(reference)
    got, got_grads, got_kept = step(model)
    relative = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=0, rtol=relative / 10)
    assert got_grads.keys() == want_grads.keys() and sum("lora_" in n for n in got_grads) == 4 * len(TARGETS)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=relative * grad.abs().max().item(), rtol=0, msg=name)
    assert got_kept <= want_kept


def test_what_it_does_not_fuse_runs_peft_s_forward():
    _check_what_it_does_not_fuse_runs_peft_s_forward("cpu")


@pytest.mark.gpu
def test_what_it_does_not_fuse_runs_peft_s_forward_on_cuda():
    _check_what_it_does_not_fuse_runs_peft_s_forward("cuda")


def _check_what_it_does_not_fuse_runs_peft_s_forward(device: str) -> None:
    reference = tiny_lora(torch.float32, use_dora=True, device=device)
    model = copy.deepcopy(reference)
    lora_linear.install(model)
    want, want_grads, _ = step(reference)
    got, got_grads, _ = step(model)
    assert torch.equal(got, want) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
    plain = tiny_lora(torch.float32, device=device)
    fused = copy.deepcopy(plain)
    lora_linear.install(fused)
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        with plain.disable_adapter(), fused.disable_adapter():
            assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
        plain.merge_adapter()
        fused.merge_adapter()
        assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_under_zero3_only_the_decoder_layers_lora_is_fused():
    """ZeRO-3 gathers the decoder layers whole (their LoRA layers' weights with them) and any other module when it is
    called, which the fused forward never does: a LoRA head stays PEFT's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from tools.tiny_model import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(vocab_size=101, num_hidden_layers=2))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=[*TARGETS, "lm_head"]))
    partitioned = copy.deepcopy(model)
    assert lora_linear.install(model) == 2 * len(TARGETS) + 1
    assert lora_linear.install(partitioned, partitioned=True) == 2 * len(TARGETS)
    assert "forward" not in vars(partitioned.base_model.model.lm_head)  # PEFT's own
