"""Packed SFT rows attend only within themselves under every `train.attention`. Each choice gives the padded
batch's loss and gradients:
- eager and SDPA: transformers builds a block-diagonal mask from the restarting positions;
- flash-attention 2's variable-length path. It runs here on CPU through a reference of flash_attn_varlen_func,
  registered with transformers' flash mask (no mask) and reading the rows' bounds from `pack(varlen=True)`. On a GPU
  the real kernel takes the same arguments; CI has no GPU, so that path is untested here."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from pipeline.data.batches import bucketed_width, collate, pack
from tests.unit.kernels.test_fused_loss import batch, loss_and_grads, tiny_lora

VARLEN = "varlen_reference"
LENGTHS = (17, 12, 9)


def varlen_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """What flash-attention computes: with cu_seq_lens (flash_attn_varlen_func, one packed sequence) causal attention
    within each row, none across; without, causal attention over each sequence of the batch (query, key, value:
    (batch, heads, tokens, head size))."""
    assert attention_mask is None, "the flash path builds no mask"
    if "cu_seq_lens_q" not in kwargs:
        output = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None
    starts = kwargs["cu_seq_lens_q"].tolist()
    assert starts == kwargs["cu_seq_lens_k"].tolist()
    assert kwargs["max_length_q"] == max(b - a for a, b in itertools.pairwise(starts))
    output = torch.empty_like(query)
    for a, b in itertools.pairwise(starts):
        output[:, :, a:b] = F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True
        )
    return output.transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def registered():
    AttentionInterface.register(VARLEN, varlen_reference)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)


def rows() -> list[dict]:
    inputs = batch()
    return [{"input_ids": inputs["input_ids"][i, :n], "labels": inputs["labels"][i, :n]} for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", VARLEN])
def test_packed_rows_give_the_padded_batch_under_every_attention(attention, bucketed):
    """`bucketed` (the compiled layers' static shapes): the 38 packed positions padded to 64 by a row of pads."""
    model = tiny_lora([])
    model.set_attn_implementation(attention)
    want, want_grads = loss_and_grads(model, collate(rows(), pad_id=0))
    packed = pack(rows(), pad_id=0, varlen=attention == VARLEN, bucketed=bucketed)
    assert packed["input_ids"].shape == (1, 64 if bucketed else sum(LENGTHS))
    got, got_grads = loss_and_grads(model, packed)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_bucketed_widths_are_few_and_waste_at_most_an_eighth():
    widths = [bucketed_width(n) for n in range(1, 8193)]
    assert bucketed_width(1900) == 1920 and bucketed_width(2048) == 2048 and bucketed_width(5) == 64
    assert all(n <= w <= max(64, n * 1.125) for n, w in zip(range(1, 8193), widths, strict=True))
    assert len(set(widths)) == 1 + 8 * 7  # 64, then 8 an octave up to 8,192


def test_the_rows_bounds_are_what_flash_reads_from_the_positions():
    packed = pack(rows(), pad_id=0, varlen=True)
    (starts, _), (longest, _) = prepare_fa_kwargs_from_position_ids(packed["position_ids"])
    assert packed["cu_seq_lens_q"].tolist() == starts.tolist() == [0, 17, 29, 38]
    assert packed["cu_seq_lens_q"].dtype == starts.dtype == torch.int32
    assert packed["max_length_q"] == int(longest) == 17


def test_rows_that_see_each_other_give_another_loss():
    """The check above can fail: bounds of one row across the three (what a missing mask would do) change it."""
    model = tiny_lora([])
    model.set_attn_implementation(VARLEN)
    want, _ = loss_and_grads(model, collate(rows(), pad_id=0))
    packed = pack(rows(), pad_id=0, varlen=True)
    total = sum(LENGTHS)
    packed |= {"cu_seq_lens_q": torch.tensor([0, total], dtype=torch.int32), "max_length_q": total}
    packed |= {"cu_seq_lens_k": packed["cu_seq_lens_q"], "max_length_k": total}
    got, _ = loss_and_grads(model, packed)
    assert not torch.allclose(got, want, atol=1e-3)
