"""Activation checkpointing whose kept tensors live in host memory (ALST's checkpoint offload), for one long
sequence on a GPU: with checkpointing each decoder layer keeps only its input (tokens x hidden), but over every layer
that still grows with the sequence (an 8B model at 500k tokens: 134 GB in bf16); here each layer's input is copied
to pinned host memory as the forward pass leaves the layer, and back when the backward pass recomputes it.

PyTorch's non-reentrant checkpoint, around a function that takes the host copy and moves it to the device: autograd
follows both copies, so gradients reach the layer's input as before, and the frozen-embedding case (an input that
needs no gradient) needs nothing special. On a CPU the input already is in host memory: plain checkpointing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def offloaded_checkpoint(function, hidden: torch.Tensor, *args, **kwargs):
    """`function(hidden, *args)` checkpointed, `hidden` kept in host memory (transformers' checkpointing function
    signature: a layer's forward with its keyword arguments bound, then its positional ones)."""
    kwargs.setdefault("use_reentrant", False)
    if hidden.device.type == "cpu":
        return checkpoint(function, hidden, *args, **kwargs)
    device = hidden.device
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    host = host.copy_(hidden, non_blocking=True)  # in the autograd graph: the gradient goes back to `hidden`
    return checkpoint(lambda kept, *rest: function(kept.to(device, non_blocking=True), *rest), host, *args, **kwargs)


def install(model: torch.nn.Module) -> int:
    """Make every checkpointed decoder layer of `model` keep its input in host memory; how many layers (0 where
    checkpointing is off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer._gradient_checkpointing_func = offloaded_checkpoint
    return len(layers)
