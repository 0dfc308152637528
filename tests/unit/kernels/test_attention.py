"""The CPU attention (pipeline/kernels/attention.py), bf16 and fp32: SDPA's forward bit for bit, gradients as close to
an fp64 reference as transformers' eager attention's (causal, packed rows, right-padded rows, a mask that is not causal;
grouped and plain heads; one block of queries or several); its two kernels against the formulas they compute; in a
model, SDPA's losses; anything else left to transformers' SDPA."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from pipeline.kernels import attention as cpu_attention
from pipeline.kernels import cpp as cpu_kernels
from tools.tiny_model import tiny_llama_config


@pytest.fixture(scope="module")
def built():
    """The kernels this process's models get (`PIPELINE_KERNELS_ISA`'s path; native by default)."""
    kernels = cpu_kernels.load()
    assert kernels is not None, "make setup builds pipeline/kernels/csrc/kernels.cpp; with gcc it must build"
    return kernels


def attends(lengths: list[int], *, packed: bool) -> torch.Tensor:
    """A boolean (batch, 1, tokens, tokens) mask: rows packed end to end in one sequence, or one per sequence with
    the right padding of the longest."""
    tokens = sum(lengths) if packed else max(lengths)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    if packed:
        row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return (causal & (row[:, None] == row[None, :]))[None, None]
    real = torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]
    return (causal[None] & real[:, None, :])[:, None]


CASES = {  # batch, heads, kv heads, tokens, mask
    "causal, grouped heads": (2, 6, 2, 96, None),
    "causal, plain heads": (1, 4, 4, 80, None),
    "packed rows": (1, 6, 3, 100, attends([61, 39], packed=True)),
    "right-padded rows": (2, 6, 2, 72, attends([72, 50], packed=False)),
    "not causal": (1, 4, 2, 40, torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(2)) < 0.7),
}


def gradients(function, query, key, value, grad):
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    output = function(*inputs)
    output.backward(grad)
    return output.detach(), [t.grad.double() for t in inputs]


def relative_errors(grads, reference):
    return [((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference, strict=True)]


@pytest.mark.parametrize("block", [16, 1000], ids=["blocks", "one_block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_forward_is_sdpa_and_gradients_as_close_as_eager(compiled, case, dtype, block, monkeypatch):
    monkeypatch.setitem(cpu_attention.QUERY_BLOCK, dtype, block)
    batch, heads, kv_heads, tokens, mask = CASES[case]
    torch.manual_seed(0)
    query = torch.randn(batch, heads, tokens, 32) * 2  # peaked softmax rows, as trained attention has
    key, value = torch.randn(2, batch, kv_heads, tokens, 32)
    grad = torch.randn(batch, heads, tokens, 32)
    scale = 32**-0.5
    low = [t.to(dtype) for t in (query, key, value, grad)]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    def eager(q, k, v):
        additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -1e30)
        if mask is None:
            causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            additive = torch.zeros(tokens, tokens, dtype=q.dtype).masked_fill(~causal, -1e30)
        module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
        return eager_attention_forward(module, q, k, v, additive, scaling=scale)[0].transpose(1, 2)

    def ours(q, k, v):
        return cpu_attention._Attention.apply(q, k, v, mask, scale, compiled)

    _, exact = gradients(sdpa, *[t.double() for t in (query, key, value, grad)])
    sdpa_output, sdpa_grads = gradients(sdpa, *low)
    _, eager_grads = gradients(eager, *low)
    our_output, our_grads = gradients(ours, *low)
    assert torch.equal(our_output, sdpa_output)
    errors = [relative_errors(g, exact) for g in (our_grads, eager_grads, sdpa_grads)]
    for ours_error, eager_error, sdpa_error in zip(*errors, strict=True):
        if dtype == torch.bfloat16:  # eager's roundings, placed where eager places them: at most eager's error
            assert ours_error < 1.15 * eager_error, (ours_error, eager_error)
        else:  # no rounding but fp32's: within what PyTorch's own fp32 attentions reach on this CPU
            assert ours_error <= max(eager_error, sdpa_error), (ours_error, eager_error, sdpa_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_compute_the_softmax_and_its_gradient(compiled, dtype):
    torch.manual_seed(0)
    kv_heads, groups, tokens = 2, 3, 40
    scores = (torch.randn(2 * kv_heads, groups * tokens, tokens) * 6).to(dtype)
    scale = 0.3
    # fp32: a few ulp (the exp's 2, the division's) and the sum of up to 40 exps in the compiler's order (Higham's
    # bound, positive terms: (n - 1) u); bf16: the result's rounding
    eps = torch.finfo(torch.float32).eps
    fp32 = {"atol": 1e-7, "rtol": 4 * eps + (tokens - 1) * eps / 2}
    rounding = {"atol": 1e-7, "rtol": 2**-8} if dtype == torch.bfloat16 else fp32
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril().repeat(groups, 1)
    expected = torch.softmax((scores.float() * scale).masked_fill(~causal, float("-inf")), -1)
    probs = compiled.probs(scores, scale, None, tokens, kv_heads, 0, True)
    torch.testing.assert_close(probs.float(), expected, **rounding)
    assert not probs.float().masked_select(~causal).any()
    # a block: queries 24-31 of each group against keys 0-31, as the whole's rows
    rows = scores.view(2 * kv_heads, groups, tokens, tokens)[:, :, 24:32, :32].reshape(2 * kv_heads, groups * 8, 32)
    block = compiled.probs(rows.contiguous(), scale, None, 8, kv_heads, 24, True)
    whole = probs.view(2 * kv_heads, groups, tokens, tokens)[:, :, 24:32]
    assert torch.equal(block.view(2 * kv_heads, groups, 8, 32), whole[..., :32]) and not whole[..., 32:].any()

    mask = torch.ones(2, tokens, tokens, dtype=torch.bool).tril()  # per sequence: the second left-padded by 5
    mask[1, :, :5] = False
    first = mask[:, None].repeat(1, kv_heads, 1, 1).reshape(2 * kv_heads, 1, tokens, tokens)
    first = first.expand(-1, groups, -1, -1).reshape(2 * kv_heads, groups * tokens, tokens)
    expected = torch.softmax((scores.float() * scale).masked_fill(~first, float("-inf")), -1).nan_to_num(0.0)
    for causal in (True, False):  # the mask is within the causal one: the same either way
        masked = compiled.probs(scores, scale, mask, tokens, kv_heads, 0, causal)
        torch.testing.assert_close(masked.float(), expected, **rounding)
        assert not masked.view(2, kv_heads, groups, tokens, tokens)[1, :, :, :5].any()  # attend nowhere: zeros
    masked_block = compiled.probs(rows.contiguous(), scale, mask, 8, kv_heads, 24, True)
    whole = masked.view(2 * kv_heads, groups, tokens, tokens)[:, :, 24:32, :32]
    assert torch.equal(masked_block.view(2 * kv_heads, groups, 8, 32), whole)

    grad_probs = torch.randn(scores.shape).to(dtype)
    p, g = probs.float(), grad_probs.float()
    expected = p * (g - (p * g).sum(-1, keepdim=True))
    ours = compiled.grad_scores(probs, grad_probs).float()
    if dtype == torch.bfloat16:
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=2**-8)
    else:  # each row's dot product (40 terms), ours and the reference's, each in its own order: (n - 1) u sum |terms|
        dots = 2 * (tokens - 1) * eps / 2 * (p * g).abs().sum(-1, keepdim=True) * p
        assert ((ours - expected).abs() <= dots + 2 * eps * expected.abs()).all()


def tiny_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=101, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype).train()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["blocks", "packed rows"])
def test_in_a_model_the_loss_is_sdpa_s(built, packed, dtype):
    reference = tiny_model(dtype)
    model = copy.deepcopy(reference)
    assert cpu_attention.install(model)
    assert model.config._attn_implementation == cpu_attention.NAME
    torch.manual_seed(1)
    if packed:  # positions restart at each row: transformers builds the block-diagonal mask
        batch = {
            "input_ids": torch.randint(0, 101, (1, 50)),
            "position_ids": torch.cat([torch.arange(30), torch.arange(20)])[None],
        }
    else:
        batch = {"input_ids": torch.randint(0, 101, (2, 40))}
    losses, grads = [], []
    for m in (reference, model):
        loss = m(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    relative = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=relative * grad.abs().max().item(), rtol=0, msg=name)


def test_what_it_does_not_compute_goes_to_sdpa(built):
    assert not cpu_attention.install(tiny_model(torch.float16))
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=True)
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 8, 16).bfloat16(), *torch.randn(2, 1, 2, 8, 16).bfloat16()
    float_mask = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)
    for mask, kwargs in ((float_mask, {}), (None, {"softcap": 30.0})):
        assert not cpu_attention.applies(query, key, mask, dropout=0.0, kwargs=kwargs)
    assert not cpu_attention.applies(query, key, None, dropout=0.1, kwargs={})
    assert not cpu_attention.applies(query.half(), key.half(), None, dropout=0.0, kwargs={})
    ours, _ = cpu_attention.attention(module, query, key, value, float_mask, compiled=built)
    theirs, _ = sdpa_attention_forward(module, query, key, value, float_mask)
    assert torch.equal(ours, theirs)
