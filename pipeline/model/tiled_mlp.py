"""The MLP of every decoder layer a tile of positions at a time, through DeepSpeed ALST's `TiledMLP`
(`deepspeed.runtime.sequence_parallel.ulysses_sp`), for one long sequence: autograd keeps only the MLP's input, and
the intermediate activations (three of tokens x intermediate size a layer, the largest part of a step's memory) exist
for one tile at a time, in the forward pass and again in the backward pass, which computes each tile's forward once
more (one more MLP forward per step). Tiles: one per `hidden size` positions (DeepSpeed's rule: a tile's intermediate
activations are then about as large as the MLP's weights), a count `torch.chunk`, which DeepSpeed tiles with, always
gives. Its only tensor input is the MLP's: one that needs no gradient (the first layer's, with LoRA on the MLP only)
goes in as a leaf that does, or the MLP's weights would get none. Under ZeRO-3 each decoder layer is gathered whole
(training/rank.py: gather_whole_layers): the tiles' calls gather nothing, so ranks may tile rows of other lengths."""

from __future__ import annotations

import math
from types import MethodType

import torch


def tiles_for(tokens: int, hidden: int) -> int:
    """Tiles of about `hidden` positions each (`torch.chunk` gives exactly as many)."""
    return max(1, math.ceil(tokens / hidden))


def _untiled(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.untiled_forward(x)


def tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An MLP's forward (the one it had: `self.untiled_forward`) over tiles of `x`'s positions. Bound to each MLP as
    the same function: a compiled decoder layer then guards on that function, shared by every layer, where a
    `functools.partial` per MLP made PyTorch compile each layer again (on an H100, 8B at 128k tokens: 64 graphs, about
    100 s of the first step)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    flat = x.reshape(-1, x.shape[-1])  # positions of every row, tiled alike forward and backward
    tiles = tiles_for(len(flat), self.tiled_hidden)
    if tiles == 1:
        return self.untiled_forward(x)
    if not torch.is_grad_enabled():
        return torch.cat([self.untiled_forward(piece) for piece in flat.chunk(tiles)]).view(*x.shape[:-1], -1)
    params = [p for p in self.parameters() if p.requires_grad]
    if params and not flat.requires_grad:
        flat = flat.detach().requires_grad_()
    return TiledMLP.apply(_untiled, self, flat, tiles, params).view(*x.shape[:-1], -1)


def mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLP of each decoder layer of the causal LM inside `model` (a PEFT model or the LM)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(lm.get_decoder(), "layers", ())
    return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]


def tiled(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` runs in tiles (`install` bound `tiled_forward` to it)."""
    return getattr(mlp.forward, "__func__", None) is tiled_forward


def install(model: torch.nn.Module) -> int:
    """Tile the MLP of every decoder layer of `model` (after the other kernels, which it wraps; once); how many."""
    from pipeline.core import deepspeed_patches

    deepspeed_patches.imported()  # without MLflow (an evaluation's long windows: 0.5 s of CPU, 30 MB; else 2.1 s, 142)
    hidden = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.hidden_size
    found = mlps(model)
    for mlp in found:
        if not tiled(mlp):
            mlp.untiled_forward, mlp.tiled_hidden = mlp.forward, hidden
            mlp.forward = MethodType(tiled_forward, mlp)
            for param in mlp.parameters():  # unset means ready; set, torch.compile traces the first step as the next
                param.ds_grad_is_ready = True
    return len(found)


LONG_WINDOW = 8  # tiles of `hidden` positions from which an evaluation window's MLPs run in tiles


def install_for_window(model: torch.nn.Module, tokens: int) -> int:
    """Tile the MLPs of a model that scores windows of `tokens` positions where those are long (LONG_WINDOW tiles
    or more: their intermediate activations would otherwise be the largest thing in memory); how many."""
    hidden = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.hidden_size
    return install(model) if tokens >= LONG_WINDOW * hidden else 0
