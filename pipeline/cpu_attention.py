"""Attention for bf16 training on a CPU: SDPA's forward, the backward pass as four matmuls and two fused passes.

PyTorch's CPU flash-attention backward computes the softmax's gradient a few rows at a time around small matrix
products, at about 100 GFLOP/s where this machine's bf16 matmuls reach 1,000 (AMX): for 2 x 256 tokens, 9 heads of
64, its backward takes 7 ms of a decoder layer's 30. Here the backward recomputes the scores with one batched matmul
over all query heads of a key-value head at once (grouped-query attention without copying the key and value heads),
then the probabilities P, dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = dS K scale, dK = dS^T Q
scale. P and dS each take one pass over the (tokens x tokens) rows in C++ (pipeline/cpu_kernels.py): softmax over
the keys a query attends (causal, or the mask's), and the softmax's gradient from P and dP. P is computed as
transformers' eager attention computes it in bf16 (the scores' matmul rounded to bf16, the softmax in fp32, rounded
to bf16), and the gradients are as close to an fp64 reference as eager's (tests/test_cpu_attention.py). The forward
pass, and so every loss, is SDPA's, bit for bit. Memory: SDPA keeps the queries, keys, values, output and
log-sum-exp; this keeps the queries, keys and values, and holds one layer's (query heads x tokens x tokens) scores
while its backward runs.

Anything else (another device or dtype, dropout, soft-capping, a float mask, decoding with a cache), or a machine
where the kernels cannot be built, goes to transformers' SDPA attention unchanged."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from pipeline import cpu_kernels

NAME = "sdpa_matmul_backward"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scale, compiled):
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        ctx.save_for_backward(query, key, value, mask)
        ctx.scale, ctx.compiled = scale, compiled
        return output

    @staticmethod
    def backward(ctx, grad):
        query, key, value, mask = ctx.saved_tensors
        grads = attention_backward(query, key, value, grad, mask=mask, scale=ctx.scale, compiled=ctx.compiled)
        return *grads, None, None, None


def attention_backward(query, key, value, grad, *, mask: torch.Tensor | None, scale: float, compiled):
    """The gradients of SDPA(query, key, value) for queries (batch, heads, tokens, head size), keys and values with
    heads / groups heads each, and a boolean (batch or 1, 1, tokens, tokens) mask or causal attention; every group
    of query heads sharing a key-value head is one batch of the matmuls."""
    batch, heads, tokens, size = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch * kv_heads, groups * tokens, size)
    k = key.reshape(batch * kv_heads, tokens, size)
    v = value.reshape(batch * kv_heads, tokens, size)
    do = grad.reshape(batch * kv_heads, groups * tokens, size)
    attends = None if mask is None else mask[:, 0]
    probs = compiled.probs(torch.bmm(q, k.transpose(1, 2)), scale, attends, tokens, kv_heads)
    # (tokens x tokens) operands as stored: a transposed one would be copied; the small ones are transposed instead
    grad_value = torch.bmm(do.transpose(1, 2), probs).transpose(1, 2)
    grad_scores = compiled.grad_scores(probs, torch.bmm(do, v.transpose(1, 2)))
    grad_query = torch.bmm(grad_scores, k).mul_(scale)
    grad_key = torch.bmm(q.transpose(1, 2), grad_scores).mul_(scale).transpose(1, 2)
    return (
        grad_query.view(batch, heads, tokens, size),
        grad_key.reshape(batch, kv_heads, tokens, size),
        grad_value.reshape(batch, kv_heads, tokens, size),
    )


def applies(query, key, attention_mask, *, dropout: float, kwargs: dict) -> bool:
    """Whether this backward computes the call: bf16 on a CPU, training (queries as many as keys), no dropout, no
    soft-capping or position bias, a boolean mask or none."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and query.shape[2] == key.shape[2] > 1
        and query.shape[1] % key.shape[1] == 0
        and dropout == 0.0
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and (attention_mask is None or attention_mask.dtype == torch.bool)
    )


def attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, *, compiled, **kwargs
):
    """transformers' attention interface (with the `compiled` kernels bound): returns (batch, tokens, heads, head
    size) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not (causal or attention_mask is not None) or not applies(
        query, key, attention_mask, dropout=dropout, kwargs=kwargs
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = _Attention.apply(query, key, value, attention_mask, scale, compiled)
    return output.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> bool:
    """Make this `model`'s attention where it trains in bf16 on a CPU with transformers' SDPA (its masks stay SDPA's)
    and the kernels can be built; whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    bf16_cpu = model.dtype == torch.bfloat16 and model.device.type == "cpu"
    compiled = cpu_kernels.load() if bf16_cpu and model.config._attn_implementation == "sdpa" else None
    if compiled is None:
        return False
    AttentionInterface.register(NAME, partial(attention, compiled=compiled))
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
