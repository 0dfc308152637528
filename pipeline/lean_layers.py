"""The SwiGLU MLP and the RMSNorm of LLaMA-style decoders, computing what transformers' do with less kept for the
backward pass, bit for bit the same losses and gradients (tests/test_lean_layers.py).

- MLP, `down(silu(gate(x)) * up(x))`: autograd keeps gate(x) (for SiLU's gradient), silu(gate(x)) and up(x) (for the
  product's), three tensors of tokens x intermediate size per layer, the largest part of a LoRA step's activations
  (Llama-3-8B: 117 MB each per layer and 4k tokens in bf16). Here silu(gate(x)) is recomputed in the backward pass
  from gate(x), one elementwise pass; the product's two gradients and aten's silu_backward are then autograd's.
- RMSNorm, `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)` with x32 = x in fp32: autograd keeps x32, twice the
  size of a bf16 x, for each of the 2 norms per layer. Here x is kept, and its fp32 copy made again in the backward
  pass, which applies autograd's own derivative formulas in autograd's order (same speed). Only norms in a 16-bit
  dtype: in fp32 the copy is x itself."""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F


class _SiluTimesUp(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


class _RMSNorm(torch.autograd.Function):
    """LlamaRMSNorm's forward, keeping x (not its fp32 copy) and the reciprocal RMS."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rms)
        return weight * (x32 * rms).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rms = ctx.saved_tensors
        x32 = x.to(torch.float32)
        grad_normed = (grad * weight).to(torch.float32)
        grad_rms = (grad_normed * x32).sum(-1, keepdim=True)
        grad_square_mean = -0.5 * grad_rms * rms.pow(3)  # rsqrt's derivative, as autograd writes it
        grad_squares = grad_square_mean.expand(x32.shape) / x32.shape[-1]
        grad_x = (grad_normed * rms + grad_squares * (2 * x32)).to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * (x32 * rms).to(x.dtype)).sum_to_size(weight.shape)
        return grad_x, grad_weight, None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_SiluTimesUp.apply(self.gate_proj(x), self.up_proj(x)))


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _same_forward(module: torch.nn.Module, reference: type) -> bool:
    """Whether `module`'s forward is `reference`'s word for word (Mistral, Qwen2/3 and others copy LLaMA's)."""
    code, want = type(module).forward.__code__, reference.forward.__code__
    return code.co_code == want.co_code and code.co_names == want.co_names and code.co_consts == want.co_consts


def install(model: torch.nn.Module) -> int:
    """Give every SwiGLU MLP (LLaMA's forward with a SiLU; Gemma's has GELU) and every 16-bit LLaMA RMSNorm inside
    `model` the lean forward; how many modules that was."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    changed = 0
    for module in model.modules():
        if _same_forward(module, LlamaMLP) and isinstance(module.act_fn, SiLUActivation | torch.nn.SiLU):
            module.forward = MethodType(_mlp_forward, module)
        elif _same_forward(module, LlamaRMSNorm) and module.weight.dtype in (torch.bfloat16, torch.float16):
            module.forward = MethodType(_norm_forward, module)
        else:
            continue
        changed += 1
    return changed
