"""The lean SwiGLU MLP and RMSNorm (pipeline/lean_layers.py): bit for bit transformers' loss and gradients, with
LoRA on the MLP's own projections and a trained norm, in fp32 and bf16; a third less of the MLP's tensors and (in
bf16) none of the norms' fp32 copies kept for the backward pass (fp32 norms are left as they are: nothing to save);
an MLP whose activation is not SiLU left alone."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from pipeline import lean_layers
from pipeline.base_model import tiny_llama_config

LAYERS, HIDDEN, INTERMEDIATE, TOKENS = 2, 32, 96, 2 * 17
NORMS = 2 * LAYERS + 1


def tiny_lora(dtype: torch.dtype, hidden_act: str = "silu") -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=101, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, hidden_act=hidden_act
    )
    model = LlamaForCausalLM(config).to(dtype)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "gate_proj", "up_proj"],
        modules_to_save=["model.norm"],
    )
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    for name, param in model.named_parameters():  # B away from zero: every LoRA tensor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.train()


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[tuple, int]]:
    """Loss, the trained tensors' gradients, and how many activations of each (width, dtype) are kept for backward."""
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    kept: dict[int, tuple] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() and tensor.numel() == TOKENS * tensor.shape[-1]:
            kept[tensor.untyped_storage().data_ptr()] = (tensor.shape[-1], tensor.dtype)
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, Counter(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_layers_are_bit_identical_and_keep_less(dtype):
    reference = tiny_lora(dtype)
    lean = copy.deepcopy(reference)
    norms = NORMS + 1 if dtype == torch.bfloat16 else 0  # the final one twice: frozen and its trained copy
    assert lean_layers.install(lean) == LAYERS + norms
    want, want_grads, want_kept = step(reference)
    got, got_grads, got_kept = step(lean)
    assert torch.equal(got, want)
    trained = ("mlp.gate_proj.lora_A", "mlp.up_proj.lora_B", "model.norm.modules_to_save")
    assert got_grads.keys() == want_grads.keys() and all(any(t in n for n in got_grads) for t in trained)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert (want_kept[INTERMEDIATE, dtype], got_kept[INTERMEDIATE, dtype]) == (3 * LAYERS, 2 * LAYERS)
    if dtype == torch.bfloat16:  # each layer's norms kept their input's fp32 copy; now nothing in fp32 that wide
        assert want_kept[HIDDEN, torch.float32] >= 2 * LAYERS and got_kept[HIDDEN, torch.float32] == 0


def test_other_activations_keep_their_forward():
    model = tiny_lora(torch.bfloat16, hidden_act="gelu_pytorch_tanh")
    assert lean_layers.install(model) == NORMS + 1  # the norms only
