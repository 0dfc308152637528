"""Each decoder layer through `torch.compile`: the elementwise work between the matrix products (norms, rotary
embedding, SwiGLU, LoRA's scaling and sums, residual additions) fused into a few generated kernels, forward and
backward, where the eager layer launches one kernel per operator.

Compiled per layer, not whole: ZeRO-1/2's gradient hooks stay outside the graphs (they fire as each trained
tensor's gradient is accumulated), and every layer runs the same graph (the layers differ only in their parameters,
which the graph takes as inputs). Activation checkpointing stays outside the graph too, in eager PyTorch around the
compiled forward: transformers checkpoints inside `forward`, so compiling the layer as it is put the checkpoint into
the graph, where PyTorch 2.11's partitioner kept the activations anyway (on an H100, 8B at 4k tokens with
checkpointing on every layer: 33.1 GB and no recomputation, against 34.1 GB without; on CPU 633 MB against 192 MB
with the checkpoint outside). Not under ZeRO-3, whose hooks gather and release each module's parameters inside the
layer. Shapes are static, one graph for each: the training loop pads its batches to a few widths
(`data.batches.bucketed_width`, at most 8 between two powers of two) where these layers are installed. Packed text
blocks keep one graph; SFT rows and DPO pairs, whose lengths change every step, a few. Neither one graph per length
(on an H200, 26 graphs and 9 s of compiling a step at 416 tokens/s) nor one graph for any length (PyTorch's automatic
dynamic shapes, whose graph cost the host about twice as much a call on torch 2.11: DPO at 0.56x the LM step, the
GPU waiting 259 ms of a 496 ms step). `compiled_graphs` in metrics/train.json counts them."""

from __future__ import annotations

import functools

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

CACHE_LIMIT = 128  # graphs kept per layer code (PyTorch: 8): two a width (the first layer takes no gradient), x modes


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (transformers marks them as GradientCheckpointingLayer)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def install(model: torch.nn.Module) -> int:
    """Compile every decoder layer of `model` in place (on its first call); how many."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_LIMIT)
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = _compiled_forward(layer)
    return len(layers)


def _compiled_forward(layer: torch.nn.Module):
    """The layer's own forward compiled, under the layer's checkpointing function where it checkpoints (read at
    each call: `recompute_only_last` and train/eval mode change it)."""
    own = type(layer).forward
    compiled = torch.compile(functools.partial(getattr(own, "__wrapped__", own), layer), dynamic=False)

    def forward(*args, **kwargs):
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(functools.partial(compiled, **kwargs), *args)
        return compiled(*args, **kwargs)

    return forward


def graphs() -> int:
    """The graphs compiled so far in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
