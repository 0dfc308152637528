"""Activation checkpointing whose kept tensors live in host memory (ALST's checkpoint offload), for one long
sequence on a GPU: with checkpointing each decoder layer keeps only its input (tokens x hidden), but over every layer
that still grows with the sequence (an 8B model at 128k tokens: 34 GB in bf16); here each layer's input is copied to
pinned host memory as the forward pass leaves the layer, and back when the backward pass recomputes it.

A checkpoint of its own (as DeepSpeed's `cpu_checkpointing` one): the forward pass runs the layer without a graph and
keeps the host copy; the backward pass copies it back, recomputes the layer with the RNG state of the forward pass
(dropout draws the same masks) and back-propagates through it, the weights' gradients accumulating there. Where the
layer has trained weights, an input of no elements that needs a gradient makes the output need one, so that a layer
whose input needs no gradient (the first, with frozen embeddings) still trains; the weights themselves are not inputs
(PyTorch would run their AccumulateGrad, and ZeRO's hooks, once more after the recomputation's, for a None gradient:
ZeRO-1/2 would reduce them twice). The input's gradient never leaves the device (PyTorch's checkpoint around a host
tensor would send it through host memory and back, synchronously, in every layer)."""

from __future__ import annotations

from functools import partial

import torch


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, hidden: torch.Tensor, args: tuple, anchor: torch.Tensor | None) -> torch.Tensor:
        ctx.function, ctx.args, ctx.device = function, args, hidden.device
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.device.type == "cuda" else None
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=hidden.device.type == "cuda")
        ctx.host = host.copy_(hidden, non_blocking=True)
        with torch.no_grad():
            out = function(hidden, *args)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"offloaded checkpoints: a layer returning {type(out).__name__}; expected a tensor")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden = ctx.host.to(ctx.device, non_blocking=True).requires_grad_(ctx.needs_input_grad[1])
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad():
                out = ctx.function(hidden, *ctx.args)
        torch.autograd.backward(out, grad)
        return None, hidden.grad, None, None


def offloaded_checkpoint(function, hidden: torch.Tensor, *args, params: tuple = (), **_):
    """`function(hidden, *args)` checkpointed with `hidden` kept in host memory (transformers' checkpointing function
    signature: a layer's forward with its keyword arguments bound, then its positional ones); `params`: the layer's
    trained weights."""
    if not torch.is_grad_enabled():
        return function(hidden, *args)
    anchor = torch.empty(0, device=hidden.device, requires_grad=True) if params else None
    return _OffloadedCheckpoint.apply(function, hidden, args, anchor)


def install(model: torch.nn.Module) -> int:
    """Make every checkpointed decoder layer of `model` keep its input in host memory; how many layers (0 where
    checkpointing is off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        trained = tuple(p for p in layer.parameters() if p.requires_grad)
        layer._gradient_checkpointing_func = partial(offloaded_checkpoint, params=trained)
    return len(layers)
