"""The fused head + cross-entropy (pipeline/kernels/fused_loss.py) against transformers' own loss: same loss, same
gradients for every trained tensor, with prompt-masked and padded labels, a trained head, pre-shifted labels and
several chunks; without gradients it only scores."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from pipeline.data import batches
from pipeline.data.batches import collate, pack
from pipeline.data.examples import IGNORE_INDEX
from pipeline.kernels import fused_loss
from tests.helpers.devices import deterministic_attention
from tools.tiny_model import tiny_llama_config


def tiny_lora(modules_to_save: list[str], dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    # no cache, as pipeline.model.lora loads the model for training: packed rows need it
    config = tiny_llama_config(vocab_size=101, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config).to(dtype)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save
    )
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():  # B away from zero: every LoRA tensor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model.to(device).train()


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :6] = IGNORE_INDEX  # a masked prompt
    labels[1, 12:] = IGNORE_INDEX  # right padding
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    with deterministic_attention(inputs["input_ids"].device):
        loss = model(**inputs).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone().float() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("modules_to_save", [[], ["lm_head"]], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize("rows", [None, 5], ids=["one_chunk", "chunks_of_5_rows"])
@pytest.mark.parametrize("masked", [False, True], ids=["selected_rows", "masked_rows"])
def test_fused_loss_equals_transformers(modules_to_save, rows, masked, monkeypatch):
    """`masked_rows`: every position's row computed, the unlabelled ones weighted 0 (a GPU's path: nothing read back
    to the host mid-step), forced on the CPU."""
    if masked:
        monkeypatch.setattr(fused_loss, "SELECTED_ROWS", ())
    _check_fused_loss_equals_transformers("cpu", torch.float32, modules_to_save, rows, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("modules_to_save", [[], ["lm_head"]], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize("rows", [None, 5], ids=["one_chunk", "chunks_of_5_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_loss_equals_transformers_on_cuda(dtype, modules_to_save, rows, monkeypatch):
    """PyTorch's operators (the C++ kernel is the CPU's): fp32 within the CPU test's tolerances; in bf16 the
    gradient of the logits is rounded to bf16 before, not after, the division by the number of rows (and the head's
    products are chunked), so within bf16's rounding, as tests/unit/kernels/test_lora_linear.py's bf16 case."""
    _check_fused_loss_equals_transformers("cuda", dtype, modules_to_save, rows, monkeypatch)


def _check_fused_loss_equals_transformers(
    device: str, dtype: torch.dtype, modules_to_save: list[str], rows: int | None, monkeypatch
) -> None:
    if rows is not None:  # else the device's default: one chunk at this size
        monkeypatch.setitem(fused_loss.CHUNK_BYTES, device, 101 * rows * dtype.itemsize)
    reference = tiny_lora(modules_to_save, dtype, device)
    fused = copy.deepcopy(reference)
    assert fused_loss.install(fused)
    inputs = batch(device)
    want, want_grads = loss_and_grads(reference, inputs)
    got, got_grads = loss_and_grads(fused, inputs)
    loss_tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2e-3}
    torch.testing.assert_close(got, want, **loss_tolerance)
    assert got_grads.keys() == want_grads.keys()
    assert any("lm_head" in n for n in got_grads) == bool(modules_to_save)
    for name, grad in want_grads.items():
        if dtype == torch.float32:
            torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
        else:
            torch.testing.assert_close(got_grads[name], grad, atol=2e-2 * grad.abs().max().item(), rtol=0, msg=name)
    with torch.no_grad():
        scored = fused(**inputs)
    assert scored.logits is None  # the fused path ran: no logits were made
    torch.testing.assert_close(scored.loss, want, **loss_tolerance)


def test_shifted_labels_and_plain_forward():
    """Pre-shifted targets (what packed rows need) give transformers' loss for the same targets; without labels
    the model's own forward runs (logits)."""
    reference = tiny_lora([])
    fused = copy.deepcopy(reference)
    fused_loss.install(fused)
    inputs = batch()
    targets = batches.shifted(inputs["labels"])
    want = reference(input_ids=inputs["input_ids"], labels=targets, shift_labels=targets).loss
    got = fused(input_ids=inputs["input_ids"], shift_labels=targets).loss
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        fused(input_ids=inputs["input_ids"]).logits, reference(input_ids=inputs["input_ids"]).logits
    )


@pytest.mark.parametrize("masked", [False, True], ids=["selected_rows", "masked_rows"])
def test_a_stated_denominator_gives_transformers_sum_over_it(masked, monkeypatch):
    """`num_items_in_batch` (what a sequence-parallel rank passes: its group's labelled tokens) divides the sum, as
    transformers' loss does, on both paths (the masked rows': a GPU's, forced on the CPU); gradients too."""
    if masked:
        monkeypatch.setattr(fused_loss, "SELECTED_ROWS", ())
    reference = tiny_lora(["lm_head"])
    fused = copy.deepcopy(reference)
    fused_loss.install(fused)
    inputs = {**batch(), "num_items_in_batch": 100}  # more than this micro-batch's labelled tokens
    want, want_grads = loss_and_grads(reference, inputs)
    got, got_grads = loss_and_grads(fused, inputs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_packed_rows_equal_padded_batch():
    """SFT rows of several lengths packed end to end (positions restarting, no row seeing another) give the padded
    batch's loss and gradients, through the fused loss and through transformers' own."""
    ids = batch()["input_ids"]
    labels = batch()["labels"]
    rows = [{"input_ids": ids[i, :n], "labels": labels[i, :n]} for i, n in enumerate((17, 12, 9))]
    for install in (False, True):
        model = tiny_lora([])
        if install:
            fused_loss.install(model)
        want, want_grads = loss_and_grads(model, collate(rows, pad_id=0))
        packed = pack(rows, pad_id=0)
        assert packed["input_ids"].shape == (1, 17 + 12 + 9)
        got, got_grads = loss_and_grads(model, packed)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    same = [{"input_ids": ids[i], "labels": labels[i]} for i in range(3)]
    assert pack(same, pad_id=0).keys() == {"input_ids", "labels"}  # packed text blocks stay a plain batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_kernel_computes_what_the_operators_do(compiled, dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 3001, generator=generator) * 4).to(dtype)  # a vocabulary the vector width does not divide
    targets = torch.randint(0, 3001, (7,), generator=generator)
    expected, grad = fused_loss.softmax_cross_entropy(logits.clone(), targets)  # over the logits when fp32
    written = logits.clone()
    losses = compiled.cross_entropy_rows(written, targets, True)
    # Each row's sum of 3001 exps is the compiler's, 16, 8 or 1 lanes at a time (cpp.py): in any order within
    # (n - 1) u of the exact sum (Higham's bound, positive terms), and so of the operators'. The loss, peak +
    # log(sum) - target logit, then rounds twice on each side at the size of peak + log(sum). Divided by the same
    # sum, the probabilities agree within a few ulp (the exp's 2, the division's).
    eps = torch.finfo(torch.float32).eps
    sums = 2 * (3001 - 1) * eps / 2
    rounding = 4 * eps * (logits.float().amax(dim=1).abs() + math.log(3001))
    if dtype == torch.float32:  # the sums' ratio measured on the probabilities, the rest to the ulp
        onehot = torch.zeros_like(grad, dtype=torch.bool).scatter_(1, targets[:, None], True)
        ratio = (written / grad).masked_fill(onehot, float("nan")).nanmedian(dim=1).values  # sum(ops) / sum(ours)
        assert ((ratio - 1).abs() <= sums).all(), ratio
        assert ((losses + ratio.log() - expected).abs() <= rounding).all(), losses + ratio.log() - expected
        probs = (grad + onehot) * ratio[:, None]  # the operators' softmax, over our sum
        torch.testing.assert_close(written + onehot, probs, atol=2 * eps, rtol=4e-7)
    else:  # bf16: within one ulp (2**-7 at the bottom of a binade: a value the two round on either side of a midpoint)
        assert ((losses - expected).abs() <= sums + rounding).all(), losses - expected
        torch.testing.assert_close(written.float(), grad.to(dtype).float(), atol=1e-9, rtol=2**-7)
    untouched = logits.clone()
    torch.testing.assert_close(compiled.cross_entropy_rows(untouched, targets, False), losses, atol=0, rtol=0)
    assert torch.equal(untouched, logits)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        compiled.cross_entropy_rows(logits.clone(), torch.full((7,), 3001), True)
