"""Each decoder layer through `torch.compile`: the elementwise work between the matrix products (norms, rotary
embedding, SwiGLU, LoRA's scaling and sums, residual additions) fused into a few generated kernels, forward and
backward, where the eager layer launches one kernel per operator.

Compiled per layer, not whole: ZeRO-1/2's gradient hooks stay outside the graphs (they fire as each trained
tensor's gradient is accumulated), activation checkpointing recomputes a compiled layer, and every layer runs the
same graph (the layers differ only in their parameters, which the graph takes as inputs). Not under ZeRO-3, whose
hooks gather and release each module's parameters inside the layer. Shapes start static and turn dynamic on the
first change (PyTorch's automatic dynamic shapes): packed text blocks keep one static graph; SFT rows and DPO pairs,
whose lengths change every step, compile one more graph that takes any length, not one per length (on an H200 that
was 26 graphs and 9 s of compiling a step at 415 tokens/s under `dynamic=False`). `compiled_graphs` in
metrics/train.json counts them."""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

CACHE_LIMIT = 64  # graphs kept per layer's code (PyTorch's default 8 is per code object, shared by the layers)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (transformers marks them as GradientCheckpointingLayer)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def install(model: torch.nn.Module) -> int:
    """Compile every decoder layer of `model` in place (on its first call); how many."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_LIMIT)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=None)
    return len(layers)


def graphs() -> int:
    """The graphs compiled so far in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
