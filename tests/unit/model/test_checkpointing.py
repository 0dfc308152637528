"""Activation checkpointing on only the last decoder layers (what `train.gradient_checkpointing: auto` picks where the
run fits with some layers keeping their activations): those layers recompute, the others do not, and the loss and
gradients are those of the model without checkpointing."""

from __future__ import annotations

import copy

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from pipeline.model.lora import recompute_only_last
from tests.helpers.lora_model import step, tiny_lora


def test_only_the_last_layers_recompute_and_train_the_same():
    plain = tiny_lora(torch.float32, layers=3)
    partial = copy.deepcopy(plain)
    partial.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert recompute_only_last(partial, 1) == 3
    layers = [m for m in partial.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [layer.gradient_checkpointing for layer in layers] == [False, False, True]
    want_loss, want, kept_plain = step(plain)
    got_loss, got, kept_partial = step(partial)
    torch.testing.assert_close(got_loss, want_loss, atol=0, rtol=0)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-6, msg=name)
    assert kept_partial < kept_plain, "the recomputed layer keeps less for the backward pass"
