"""The SwiGLU MLP and the RMSNorm of LLaMA-style decoders, computing what transformers' do with less kept for the
backward pass: on a CPU (bf16, fp32) each as one C++ pass forward and one backward (pipeline/kernels/cpp.py), elsewhere
with PyTorch's operators, bit for bit transformers' losses and gradients (tests/unit/kernels/test_lean_layers.py).

- MLP, `down(silu(gate(x)) * up(x))`: autograd keeps gate(x) (for SiLU's gradient), silu(gate(x)) and up(x) (for the
  product's), three tensors of tokens x intermediate size per layer, the largest part of a LoRA step's activations.
  Here silu(gate(x)) is recomputed in the backward pass from gate(x), one elementwise pass; the product's two
  gradients and aten's silu_backward are then autograd's.
- RMSNorm, `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)` with x32 = x in fp32: autograd keeps x32, twice the
  size of a bf16 x, for each of the 2 norms per layer. Here x is kept, and its fp32 copy made again in the backward
  pass, which applies autograd's own derivative formulas in autograd's order (same speed). With PyTorch's
  operators only norms in a 16-bit dtype (in fp32 the copy is x itself); on a CPU every norm, for the kernels.
- The C++ passes round bf16 results where PyTorch's operators round them, and compute the same formulas: the
  SwiGLU product and its gradients (exp within 2 ulp) and the RMSNorm (another summation order) within fp32's
  rounding of the operators' results, in bf16 mostly bit for bit (figures: docs/kernels.md)."""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F

from pipeline.kernels import cpp

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _kernels(x: torch.Tensor):
    """The C++ kernels where they compute `x`'s layer: on a CPU, in bf16 or fp32, and built; else None."""
    return cpp.load() if x.device.type == "cpu" and x.dtype in KERNEL_DTYPES else None


class _SiluTimesUp(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        compiled = _kernels(gate) if gate.dtype == up.dtype else None
        if compiled is not None:
            gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.compiled = compiled
        return F.silu(gate) * up if compiled is None else compiled.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.compiled is not None:
            return tuple(ctx.compiled.silu_mul_backward(grad.contiguous(), gate, up))
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


class _RMSNorm(torch.autograd.Function):
    """LlamaRMSNorm's forward, keeping x (not its fp32 copy) and the reciprocal RMS."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compiled = _kernels(x) if weight.dtype == x.dtype else None
        ctx.compiled = compiled
        if compiled is not None:
            x = x.contiguous()
            out, rms = compiled.rms_norm(x, weight.detach().contiguous(), eps)
            ctx.save_for_backward(x, weight, rms.view(*x.shape[:-1], 1))
            return out
        x32 = x.to(torch.float32)
        rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rms)
        return weight * (x32 * rms).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rms = ctx.saved_tensors
        x32 = x.to(torch.float32) if ctx.compiled is None or ctx.needs_input_grad[1] else None
        if ctx.compiled is not None:
            grad_x = ctx.compiled.rms_norm_backward(grad.contiguous(), x, weight.detach().contiguous(), rms)
        else:
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


def install(model: torch.nn.Module, *, cpp: bool = True) -> int:
    """Give every SwiGLU MLP (LLaMA's forward with a SiLU; Gemma's has GELU) and every LLaMA RMSNorm inside `model`
    that is in a 16-bit dtype, or (with `cpp`: the model trains on a CPU) computed by the C++ kernels, the lean
    forward; how many modules that was."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    changed = 0
    for module in model.modules():
        if _same_forward(module, LlamaMLP) and isinstance(module.act_fn, SiLUActivation | torch.nn.SiLU):
            module.forward = MethodType(_mlp_forward, module)
        elif _same_forward(module, LlamaRMSNorm) and (
            module.weight.dtype in (torch.bfloat16, torch.float16) or (cpp and _kernels(module.weight) is not None)
        ):
            module.forward = MethodType(_norm_forward, module)
        else:
            continue
        changed += 1
    return changed
