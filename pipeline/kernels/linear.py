"""Frozen fp32 Linear layers on a CPU through oneDNN's matmul instead of MKL's sgemm, which PyTorch calls for fp32.

A LoRA step in fp32 on a CPU is mostly matmuls through frozen weights (the forward pass and the backward pass's
input gradients); oneDNN's matmul (PyTorch's `mkldnn::_linear_pointwise`, an inference op) runs them nearer the
core's fp32 peak than MKL's sgemm (figures: docs/kernels.md). bf16 matmuls already go to oneDNN.

It is the same product in another summation order: outputs within fp32 rounding of MKL's, as far from an fp64
reference (tests/unit/kernels/test_linear.py). A layer keeps what nn.Linear keeps for its backward pass (the weight, no
activation): dX = dY W, the same matmul with the weight transposed in place. Trained layers (LoRA's A and B,
modules_to_save) stay nn.Linear.

Every kernel's product goes through `matmul_nt`, which elsewhere calls ATen's linear itself: under ZeRO-3,
DeepSpeed's zero.Init replaces `torch.nn.functional.linear` for the whole process with its memory-efficient autograd
function (`memory_efficient_linear`), Python at every call and another kernel (matmul, not addmm). The kernels'
products run inside autograd functions of their own, which keep what their backward needs: the wrapper only cost time
(a ZeRO-3 step 386 -> 305 ms on a CPU rank whose arithmetic is small; docs/kernels.md), and ZeRO-3 now multiplies as
ZeRO-2 does."""

from __future__ import annotations

from types import MethodType

import torch

ATEN_LINEAR = torch._C._nn.linear  # what torch.nn.functional.linear is until DeepSpeed's ZeRO-3 replaces it
# PyTorch builds without oneDNN (and so without this op) fall back to ATen's linear
_MATMUL = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def applies(weight: torch.Tensor) -> bool:
    """Whether a matmul with `weight` goes to oneDNN here: fp32 on a CPU, in a PyTorch built with it."""
    return _MATMUL is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


def matmul_nt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x of any leading dimensions, without autograd: oneDNN's where it applies, else
    ATen's linear (never DeepSpeed's replacement of it)."""
    if not applies(weight):
        return ATEN_LINEAR(x, weight, bias)
    return _MATMUL(x, weight, bias, "none", [], "")


class _FrozenLinear(torch.autograd.Function):
    """x @ weight.T + bias with a frozen weight and bias: only x's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return matmul_nt(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return matmul_nt(grad, weight.T), None, None


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return _FrozenLinear.apply(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Give every frozen fp32 nn.Linear on a CPU inside `model` (frozen bias or none) the oneDNN forward; how many."""
    changed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.requires_grad or not applies(module.weight):
            continue
        if module.bias is not None and module.bias.requires_grad:
            continue
        module.forward = MethodType(_forward, module)
        changed += 1
    return changed
