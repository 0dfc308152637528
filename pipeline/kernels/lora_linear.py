"""A PEFT LoRA Linear layer's training step as one autograd function: y = x W^T + b + s (x_d A^T) B^T, with x_d
LoRA's dropout of x (x itself without dropout).

PEFT computes the branch as separate operators, lora_B(lora_A(x_d)) * s, then adds it to the base's output; its backward
scales the gradient, runs both layers' backward passes and adds the branch's input gradient to the base's: four passes
over (tokens x width) tensors per layer and step besides the matmuls, and their temporaries. Here the branch is added
into the base's output by one matmul (addmm, alpha = s), and in the backward pass s scales the (tokens x r) product only
and the branch's input gradient is added into the base's by one matmul. The same products in another order: within
rounding of PEFT's (tests/unit/kernels/test_lora_linear.py). It keeps what PEFT keeps (x_d for A's gradient, x_d A^T for
B's; the frozen weight), and the base's matmuls are `linear.matmul_nt`'s. Anything else (DoRA, several or merged or
disabled adapters, mixed dtypes, a trained base) runs PEFT's own forward. Under ZeRO-3 only inside a decoder layer,
which the rank gathers whole (`training/rank.py: gather_whole_layers`): elsewhere ZeRO-3's hooks gather each module's
weights when that module is called, and this forward calls none of them."""

from __future__ import annotations

from types import MethodType

import torch

from pipeline.kernels.linear import matmul_nt


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dropped, weight, bias, lora_a, lora_b, scale: float):
        out = matmul_nt(x, weight, bias)
        branch_input = x if dropped is None else dropped
        down = matmul_nt(branch_input, lora_a)  # (..., r)
        out.view(-1, out.shape[-1]).addmm_(down.view(-1, down.shape[-1]), lora_b.T, alpha=scale)
        ctx.save_for_backward(branch_input, down, weight, lora_a, lora_b)
        ctx.scale, ctx.dropped = scale, dropped is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        branch_input, down, weight, lora_a, lora_b = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_down = (grad2 @ lora_b).mul_(ctx.scale)  # (tokens, r)
        grad_a = grad_down.T @ branch_input.reshape(-1, branch_input.shape[-1])
        grad_b = (grad2.T @ down.reshape(-1, down.shape[-1])).mul_(ctx.scale)
        grad_x = grad_dropped = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_nt(grad, weight.T)
        if ctx.dropped and ctx.needs_input_grad[1]:  # through the dropout's backward
            grad_dropped = (grad_down @ lora_a).view(branch_input.shape)
        elif not ctx.dropped and grad_x is not None:
            grad_x.view(-1, grad_x.shape[-1]).addmm_(grad_down, lora_a)
        return grad_x, grad_dropped, None, None, grad_a, grad_b, None


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT Linear's forward through _LoraLinear where it applies, else PEFT's own."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    base = self.base_layer
    simple = (
        not args
        and not kwargs
        and not self.disable_adapters
        and not self.merged
        and len(adapters) == 1
        and adapters[0] not in self.lora_variant
        and type(base) is torch.nn.Linear
        and not base.weight.requires_grad
        and (base.bias is None or not base.bias.requires_grad)
    )
    if simple:
        name = adapters[0]
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        dtypes = {x.dtype, base.weight.dtype, lora_a.weight.dtype, lora_b.weight.dtype}
        simple = lora_a.bias is None and lora_b.bias is None and len(dtypes) == 1
    if not simple:
        return type(self).forward(self, x, *args, **kwargs)
    dropped = self.lora_dropout[name](x)  # PEFT's own module: the same random draws
    if dropped is x:  # no dropout (p = 0, or not training)
        dropped = None
    return _LoraLinear.apply(
        x, dropped, base.weight, base.bias, lora_a.weight, lora_b.weight, float(self.scaling[name])
    )


def install(model: torch.nn.Module, *, partitioned: bool = False) -> int:
    """Give every PEFT LoRA Linear layer inside `model` (ZeRO-3's `partitioned` model: inside its decoder layers) the
    fused forward; how many."""
    from peft.tuners.lora.layer import Linear

    from pipeline.kernels.compiled_layers import decoder_layers

    changed = 0
    for module in (m for root in (decoder_layers(model) if partitioned else [model]) for m in root.modules()):
        if type(module) is Linear:
            module.forward = MethodType(_fused_forward, module)
            changed += 1
    return changed
