"""Attention for training on a CPU (bf16 or fp32): SDPA's forward, the backward pass as matmuls and two fused passes.

PyTorch's CPU flash-attention backward computes the softmax's gradient a few rows at a time around small matrix
products, well below the matmuls' rate (figures: docs/kernels.md). Here the backward recomputes the scores with one
batched matmul over all query heads of a key-value head at once (grouped-query attention without copying the key and
value heads), then the probabilities P, dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = dS K scale, dK =
dS^T Q scale. P and dS each take one pass over the score rows in C++ (pipeline/kernels/cpp.py): softmax over the keys a
query attends (causal, or the mask's), and the softmax's gradient from P and dP. Where no query sees a later key
(causal; packed or right-padded rows), the queries go in blocks of 64 (bf16) or 32 (fp32), each block's matmuls over the
keys up to its end only: the masked half of the scores is never computed. In bf16, P is computed as transformers' eager
attention computes it (the scores' matmul rounded to bf16, the softmax in fp32, rounded to bf16); in both precisions the
gradients are as close to an fp64 reference as eager attention's (tests/unit/kernels/test_attention.py). The forward
pass, and so every loss, is SDPA's, bit for bit. Memory: SDPA keeps the queries, keys, values, output and log-sum-exp;
this keeps the queries, keys and values, and holds one block's scores while its backward runs.

Anything else (another device or dtype, dropout, soft-capping, a float mask, decoding with a cache), or a machine
where the kernels cannot be built, goes to transformers' SDPA attention unchanged."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from pipeline.kernels import cpp

NAME = "sdpa_matmul_backward"
DTYPES = (torch.bfloat16, torch.float32)


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


QUERY_BLOCK = {torch.bfloat16: 64, torch.float32: 32}  # queries per block of causal attention (fastest here)


def query_blocks(tokens: int, dtype: torch.dtype) -> int:
    """Blocks of about QUERY_BLOCK queries that `tokens` divides into evenly (1 for short or odd lengths): block i
    attends the keys up to its end, (blocks + 1) / (2 blocks) of the full matmuls' work."""
    blocks = max(1, tokens // QUERY_BLOCK[dtype])
    while tokens % blocks:
        blocks -= 1
    return blocks


def attention_backward(query, key, value, grad, *, mask, scale, compiled):
    """The gradients of SDPA(query, key, value) for queries (batch, heads, tokens, head size), keys and values with
    heads / groups heads each, and a boolean (batch or 1, 1, tokens, tokens) mask or causal attention; every group
    of query heads sharing a key-value head is one batch of the matmuls. Where no query sees a later key (causal,
    or a mask within it: packed or padded rows) the queries go in blocks, each against the keys up to its end."""
    batch, heads, tokens, size = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    k = key.reshape(batch * kv_heads, tokens, size)
    v = value.reshape(batch * kv_heads, tokens, size)
    attends = None if mask is None else mask[:, 0]
    causal = attends is None or not attends.triu(1).any()
    blocks = query_blocks(tokens, query.dtype) if causal else 1
    step = tokens // blocks
    q4 = query.reshape(batch * kv_heads, groups, tokens, size)
    do4 = grad.reshape(batch * kv_heads, groups, tokens, size)
    grad_query = torch.empty(q4.shape, dtype=query.dtype)
    # the (tokens x tokens) operands as stored, transposed results: a transposed large operand would be copied
    grad_value_t = torch.zeros(batch * kv_heads, size, tokens, dtype=query.dtype)
    grad_key_t = torch.zeros_like(grad_value_t)
    for start in range(0, tokens, step):
        seen = start + step if causal else tokens  # the keys this block's queries may see
        q = q4[:, :, start : start + step].reshape(batch * kv_heads, groups * step, size)
        do = do4[:, :, start : start + step].reshape(batch * kv_heads, groups * step, size)
        scores = torch.bmm(q, k[:, :seen].transpose(1, 2))
        probs = compiled.probs(scores, scale, attends, step, kv_heads, start, causal)
        grad_value_t[:, :, :seen].baddbmm_(do.transpose(1, 2), probs)
        grad_scores = compiled.grad_scores(probs, torch.bmm(do, v[:, :seen].transpose(1, 2)))
        grad_query[:, :, start : start + step] = torch.bmm(grad_scores, k[:, :seen]).view(-1, groups, step, size)
        grad_key_t[:, :, :seen].baddbmm_(q.transpose(1, 2), grad_scores)
    return (
        grad_query.mul_(scale).view(batch, heads, tokens, size),
        grad_key_t.mul_(scale).transpose(1, 2).reshape(batch, kv_heads, tokens, size),
        grad_value_t.transpose(1, 2).reshape(batch, kv_heads, tokens, size),
    )


def applies(query, key, attention_mask, *, dropout: float, kwargs: dict) -> bool:
    """Whether this backward computes the call: bf16 or fp32 on a CPU, training (queries as many as keys), no
    dropout, no soft-capping or position bias, a boolean mask or none."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
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
    """Make this `model`'s attention where it trains in bf16 or fp32 on a CPU with transformers' SDPA (its masks stay
    SDPA's) and the kernels can be built; whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    on_cpu = model.dtype in DTYPES and model.device.type == "cpu"
    compiled = cpp.load() if on_cpu and model.config._attn_implementation == "sdpa" else None
    if compiled is None:
        return False
    AttentionInterface.register(NAME, partial(attention, compiled=compiled))
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
