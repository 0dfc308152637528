"""A tiny PEFT LoRA LLaMA and one training step over it, for tests that compare a layer's replacement with PEFT's."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from tests.helpers.devices import deterministic_attention
from tools.tiny_model import tiny_llama_config

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def tiny_lora(
    dtype: torch.dtype, *, dropout: float = 0.0, use_dora: bool = False, device: str = "cpu", layers: int = 2
) -> torch.nn.Module:
    """Two layers (or `layers`), LoRA r=4 on TARGETS, a trained copy of the head; B drawn away from zero so that every
    LoRA tensor gets a gradient. Drawn on the CPU, then moved to `device` (the same weights on each)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=101, num_hidden_layers=layers)).to(dtype)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, modules_to_save=["lm_head"], use_dora=use_dora
    )
    model = get_peft_model(model, config, autocast_adapter_dtype=False)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.to(device).train()


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, trained gradients (in fp32) and the bytes of activations (not parameters) kept for the backward pass,
    with the RNG seeded (dropout)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1)).to(device)
    kept = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad()
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), deterministic_attention(device):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return (
        loss.detach(),
        {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad},
        sum(kept.values()),
    )
