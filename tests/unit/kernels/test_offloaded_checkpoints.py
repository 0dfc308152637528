"""Checkpoints kept in host memory (pipeline/kernels/offloaded_checkpoints.py) on a LoRA LLaMA with LoRA dropout:
the loss and every gradient of the model without checkpointing (the recomputation draws the same dropout masks), the
first layer's LoRA weights trained although its input needs no gradient; on a GPU (marked gpu) the kept inputs in
pinned host memory, not on the device."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from pipeline.kernels import offloaded_checkpoints
from tools.tiny_model import tiny_llama_config


def tiny_lora(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=101, num_hidden_layers=3, tie_word_embeddings=False))
    model.config.use_cache = False
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.to(device).train()


def step(model, device: str = "cpu") -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(7)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert offloaded_checkpoints.install(model) == 3
    return model


def test_offloaded_checkpoints_train_as_without_checkpointing():
    plain = tiny_lora()
    expected_loss, expected = step(plain)
    loss, grads = step(checkpointed(plain))
    assert loss == expected_loss
    first = [n for n in expected if "layers.0." in n]
    assert first and all(grads[n].abs().max() > 0 for n in first), "the first layer's LoRA weights trained"
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_zero_reduces_each_weight_once():
    """ZeRO-1/2 refuse a weight whose accumulation hook fires twice in one backward ("Gradient computed twice for
    this partition"): each trained weight's fires once, in the recomputation (as weights of the function's inputs,
    once more after it)."""
    model = checkpointed(tiny_lora())
    fired = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1)
            )
    step(model)
    assert fired and all(count == 1 for count in fired.values()), fired


@pytest.mark.gpu
def test_on_a_gpu_the_kept_inputs_are_in_pinned_host_memory():
    plain = tiny_lora("cuda")
    expected_loss, expected = step(plain, "cuda")
    model = checkpointed(plain)
    kept = []
    original = offloaded_checkpoints._OffloadedCheckpoint.forward

    def spy(ctx, *args):
        out = original(ctx, *args)
        kept.append(ctx.host)
        return out

    offloaded_checkpoints._OffloadedCheckpoint.forward = staticmethod(spy)
    try:
        loss, grads = step(model, "cuda")
    finally:
        offloaded_checkpoints._OffloadedCheckpoint.forward = staticmethod(original)
    assert len(kept) == 3 and all(t.device.type == "cpu" and t.is_pinned() for t in kept)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
