"""The MLP of every decoder layer a tile of positions at a time (DeepSpeed ALST's `TiledMLP`), for one long sequence:
autograd keeps only the MLP's input, and the intermediate activations (three of tokens x intermediate size a layer,
the largest part of a step's memory) exist for one tile at a time, in the forward pass and again in the backward
pass, which computes each tile's forward once more (one more MLP forward per step).

The arithmetic is DeepSpeed's (`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`, equal in values and
gradients: tests/unit/model/test_tiled_mlp.py), with two differences: the tiles are `torch.tensor_split`'s, always as
many as asked (`torch.chunk` gives fewer for a short input, and under ZeRO-3 every rank must call the layers as
often as the others: each call gathers their weights), and DeepSpeed need not be installed (the GPU benchmark runs
without it). Tiles: one per `hidden size` positions (DeepSpeed's rule: a tile's intermediate activations are then
about as large as the MLP's weights); under ZeRO-3 the ranks agree on the largest count."""

from __future__ import annotations

import math
from types import MethodType

import torch


class _TiledMLP(torch.autograd.Function):
    """`mlp(x)` a tile of positions at a time, keeping only `x`; the backward pass recomputes each tile."""

    @staticmethod
    def forward(ctx, mlp, x: torch.Tensor, tiles: int, params: list, anchor: torch.Tensor | None) -> torch.Tensor:
        # `anchor` (a tensor of no elements that needs a gradient, where the MLP has trained weights) makes the
        # output need a gradient even where `x` does not (the first layer's MLP, LoRA on the MLP only, frozen
        # embeddings). The weights themselves are not inputs: their gradients accumulate in the backward's own
        # passes, and as inputs the outer backward would reach them once more (PyTorch runs a leaf's
        # AccumulateGrad, and its hooks, even for a None gradient): ZeRO would reduce them twice
        ctx.mlp, ctx.tiles, ctx.params = mlp, tiles, params
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([mlp(piece) for piece in flat.tensor_split(tiles)])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grads = grad.reshape(-1, grad.shape[-1]).tensor_split(ctx.tiles)
        grad_x = torch.empty_like(flat)
        start = 0
        for i, (piece, piece_grad) in enumerate(zip(flat.tensor_split(ctx.tiles), grads, strict=True)):
            for param in ctx.params:  # ZeRO reduces a weight's gradient once its last tile has added to it
                param.ds_grad_is_ready = i + 1 == ctx.tiles
            piece = piece.requires_grad_(x.requires_grad)
            with torch.enable_grad():
                torch.autograd.backward(ctx.mlp(piece), piece_grad)
            if piece.grad is not None:
                grad_x[start : start + len(piece)] = piece.grad
            start += len(piece)
        return None, grad_x.view_as(x) if x.requires_grad else None, None, None, None


def tiles_for(tokens: int, hidden: int) -> int:
    """Tiles of about `hidden` positions each."""
    return max(1, math.ceil(tokens / hidden))


def tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An MLP's forward (the one it had: `self.untiled_forward`) over tiles of `x`'s positions. Bound to each MLP as
    the same function, its settings on the module: a compiled decoder layer then guards on that function, shared by
    every layer, where a `functools.partial` per MLP made PyTorch compile each layer again (on an H100, 8B at 128k
    tokens: 64 graphs, about 100 s of the first step)."""
    inner, (hidden, partitioned) = self.untiled_forward, self.tiling
    tiles = tiles_for(x.numel() // x.shape[-1], hidden)
    if partitioned:  # ZeRO-3: every rank calls the layers the same number of times
        import deepspeed.comm as dist

        agreed = torch.tensor([tiles], device=x.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        tiles = int(agreed)
    if tiles == 1:
        return inner(x)
    if not torch.is_grad_enabled():
        pieces = x.reshape(-1, x.shape[-1]).tensor_split(tiles)
        return torch.cat([inner(piece) for piece in pieces]).view(*x.shape[:-1], -1)
    params = [p for p in self.parameters() if p.requires_grad]
    anchor = torch.empty(0, device=x.device, requires_grad=True) if params else None
    return _TiledMLP.apply(inner, x, tiles, params, anchor)


def mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLP of each decoder layer of the causal LM inside `model` (a PEFT model or the LM)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(lm.get_decoder(), "layers", ())
    return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]


def tiled(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` runs in tiles (`install` bound `tiled_forward` to it)."""
    return getattr(mlp.forward, "__func__", None) is tiled_forward


def install(model: torch.nn.Module, partitioned: bool = False) -> int:
    """Tile the MLP of every decoder layer of `model` (after the other kernels, which it wraps; once); how many."""
    hidden = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.hidden_size
    found = mlps(model)
    for mlp in found:
        if not tiled(mlp):
            mlp.untiled_forward, mlp.tiling = mlp.forward, (hidden, partitioned)
            mlp.forward = MethodType(tiled_forward, mlp)
    return len(found)


LONG_WINDOW = 8  # tiles of `hidden` positions from which an evaluation window's MLPs run in tiles


def install_for_window(model: torch.nn.Module, tokens: int) -> int:
    """Tile the MLPs of a model that scores windows of `tokens` positions where those are long (LONG_WINDOW tiles
    or more: their intermediate activations would otherwise be the largest thing in memory); how many."""
    hidden = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.hidden_size
    return install(model) if tokens >= LONG_WINDOW * hidden else 0
