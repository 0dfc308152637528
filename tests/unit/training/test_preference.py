"""The preference objectives against formulas written here from per-token log-probabilities, on a tiny LLaMA with a
LoRA adapter whose B is not zero; the reference (the adapter disabled) against the base model loaded on its own."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.data.examples import IGNORE_INDEX
from pipeline.training.preference import FUSED_TARGET_LOGPS, Objective, model_logps, pair_batch, pair_loss

PAD = 0


class Engine:
    """What the objectives call of DeepSpeed's engine: the forward, the PEFT module and its device."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, **batch):
        return self.module(**batch)


@pytest.fixture(scope="module")
def engine(tiny_base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return Engine(get_peft_model(base, config).eval())


def row(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict:
    masked = [IGNORE_INDEX] * len(prompt)
    return {
        "input_ids": prompt + chosen, "labels": masked + chosen,
        "rejected_input_ids": prompt + rejected, "rejected_labels": masked + rejected,
    }  # fmt: skip


ROWS = [row([5, 17, 99, 3], [41, 42, 2], [77, 2]), row([8, 9], [300, 301, 302, 2], [12, 13, 14, 15, 16, 2])]


def response_logps(model, ids: list[int], labels: list[int]) -> tuple[float, int]:
    """log p(response | prompt) as a sum over the response's tokens, one sequence alone (no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    total, count = 0.0, 0
    for t in range(len(ids) - 1):
        if labels[t + 1] != IGNORE_INDEX:
            total += float(torch.log_softmax(logits[t], dim=-1)[ids[t + 1]])
            count += 1
    return total, count


def by_hand(engine, rows):
    """Per pair: (chosen sum, chosen tokens, rejected sum, rejected tokens) under the adapter and under the base."""
    policy, reference = [], []
    for r in rows:
        sides = [(r["input_ids"], r["labels"]), (r["rejected_input_ids"], r["rejected_labels"])]
        policy.append([x for ids, labels in sides for x in response_logps(engine.module, ids, labels)])
        with engine.module.disable_adapter():
            reference.append([x for ids, labels in sides for x in response_logps(engine.module, ids, labels)])
    return policy, reference


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_is_the_formula_from_policy_and_reference_log_probabilities(engine):
    beta = 0.3
    loss, stats = pair_loss(engine, ROWS, pad_id=PAD, objective=Objective(kind="dpo", beta=beta, simpo_gamma=0.0))
    policy, reference = by_hand(engine, ROWS)
    losses, rewards = [], []
    for (pc, _, pr, _), (rc, _, rr, _) in zip(policy, reference, strict=True):
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        losses.append(-log_sigmoid(chosen - rejected))
        rewards.append((chosen, rejected))
    assert float(loss.detach()) == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert stats["reward_chosen"] == pytest.approx(sum(c for c, _ in rewards), abs=1e-5)
    assert stats["correct"] == sum(c > r for c, r in rewards) and stats["pairs"] == 2
    assert any(abs(pc - rc) > 1e-3 for (pc, *_), (rc, *_) in zip(policy, reference, strict=True)), "adapter acts"


def test_simpo_is_the_formula_from_mean_log_probabilities(engine):
    beta, gamma = 2.0, 0.5
    objective = Objective(kind="simpo", beta=beta, simpo_gamma=gamma)
    loss, _ = pair_loss(engine, ROWS, pad_id=PAD, objective=objective)
    policy, _ = by_hand(engine, ROWS)
    expected = [-log_sigmoid(beta * pc / nc - beta * pr / nr - gamma) for pc, nc, pr, nr in policy]
    assert float(loss.detach()) == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_orpo_is_the_chosen_nll_plus_the_weighted_odds_ratio_term(engine):
    beta = 0.1
    loss, _ = pair_loss(engine, ROWS, pad_id=PAD, objective=Objective(kind="orpo", beta=beta, simpo_gamma=0.0))
    policy, _ = by_hand(engine, ROWS)
    expected = []
    for pc, nc, pr, nr in policy:
        mean_c, mean_r = pc / nc, pr / nr
        log_odds = (mean_c - mean_r) - (math.log1p(-math.exp(mean_c)) - math.log1p(-math.exp(mean_r)))
        expected.append(-mean_c - beta * log_sigmoid(log_odds))
    assert float(loss.detach()) == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_the_reference_is_the_base_model_loaded_on_its_own(engine, tiny_base_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32).eval()
    batch = pair_batch(ROWS, PAD)
    reference, counts = model_logps(engine, batch, reference=True)
    alone, adapted = model_logps(Engine(base), batch), model_logps(engine, batch)
    torch.testing.assert_close(reference, alone[0], rtol=0, atol=1e-5)
    assert counts.tolist() == [3, 4, 2, 6]
    assert not torch.allclose(reference, adapted[0], atol=1e-3), "with the adapter enabled the figures differ"


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_pairs_padded_to_a_bucketed_width_give_the_same_loss_and_gradients(engine, kind):
    """The compiled layers' static shapes (`bucketed`: 10 positions padded to 64) change no figure of a pair."""
    objective, gradients = Objective(kind=kind, beta=0.1, simpo_gamma=0.0), []
    assert pair_batch(ROWS, PAD, bucketed=True)["input_ids"].shape == (4, 64)
    for bucketed in (False, True):
        engine.module.zero_grad()
        loss, stats = pair_loss(engine, ROWS, pad_id=PAD, objective=objective, bucketed=bucketed)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        gradients.append((loss.detach(), {k: float(v) for k, v in stats.items()}, grads))
    engine.module.zero_grad()
    (want, want_stats, want_grads), (got, got_stats, got_grads) = gradients
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got_stats == pytest.approx(want_stats, abs=1e-6)  # rewards: beta x a difference of sums of ~30
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_dpo_gradients_reach_the_adapter_and_not_the_reference(engine):
    engine.module.zero_grad()
    loss, _ = pair_loss(engine, ROWS, pad_id=PAD, objective=Objective(kind="dpo", beta=0.1, simpo_gamma=0.0))
    loss.backward()
    grads = [p.grad for n, p in engine.module.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    assert all(p.grad is None for n, p in engine.module.named_parameters() if "lora_" not in n)
    engine.module.zero_grad()


def adapted(dtype: torch.dtype, fused: bool, device: str, trained_head: bool = False) -> Engine:
    """The tests' tiny LLaMA (random, seeded) with a LoRA adapter whose B is not zero, on `device`; with
    `trained_head`, untied and its head trained in full (as an extended vocabulary trains it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from pipeline.kernels import fused_loss
    from tools.tiny_model import tiny_llama_config

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(vocab_size=512, tie_word_embeddings=not trained_head)).to(dtype)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        modules_to_save=["lm_head"] if trained_head else None,
    )  # fmt: skip
    model = get_peft_model(base, config).to(device)
    assert not fused or fused_loss.install(model)
    flag = getattr(model.get_base_model(), FUSED_TARGET_LOGPS, False)
    assert flag == (fused and not trained_head), "the fused head's log-probabilities: a frozen head, installed"
    engine = Engine(model.eval())
    engine.device = torch.device(device)
    return engine


def from_full_logits(engine, batch) -> torch.Tensor:
    """Each row's summed log-probability of its labelled next tokens from the whole batch's logits."""
    from pipeline.data.batches import shifted

    targets = shifted(batch["labels"])
    logps = torch.log_softmax(engine(input_ids=batch["input_ids"]).logits.float(), dim=-1)
    picked = logps.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (targets != IGNORE_INDEX)).sum(-1)


CASES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("masked", [False, True], ids=["selected_rows", "masked_rows"])
@pytest.mark.parametrize("trained_head", [False, True], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize(("dtype", "tolerance"), CASES, ids=["fp32", "bf16"])
def test_fused_head_and_kept_logits_equal_the_full_logits_with_their_gradients(
    dtype, tolerance, trained_head, masked, monkeypatch
):
    """The two ways the objectives take log-probabilities without the batch's logits (the fused head; transformers'
    logits_to_keep) give the figures and the adapter gradients of the whole-logits formula, rows weighted unequally
    (as DPO's per-pair gradients are); the fused head 3 positions at a time; a trained head's gradient too.
    `masked_rows`: the fused head over every position, the unlabelled ones weighted 0 (a GPU's path), on the CPU."""
    from pipeline.kernels import fused_loss

    if masked:
        monkeypatch.setattr(fused_loss, "SELECTED_ROWS", ())
    _check_ways_agree(dtype, tolerance, "cpu", monkeypatch, trained_head)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tolerance"), CASES, ids=["fp32", "bf16"])
def test_fused_head_and_kept_logits_equal_the_full_logits_on_cuda(dtype, tolerance, monkeypatch):
    _check_ways_agree(dtype, tolerance, "cuda", monkeypatch)


def _check_ways_agree(
    dtype: torch.dtype, tolerance: float, device: str, monkeypatch, trained_head: bool = False
) -> None:
    from pipeline.kernels import fused_loss

    monkeypatch.setitem(fused_loss.CHUNK_BYTES, device, 3 * 512 * dtype.itemsize)
    batch = {k: v.to(device) for k, v in pair_batch(ROWS, PAD).items()}
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0], device=device)
    found = {}
    for way in ("full", "kept", "fused"):
        engine = adapted(dtype, fused=way == "fused", device=device, trained_head=trained_head)
        sums = from_full_logits(engine, batch) if way == "full" else model_logps(engine, batch)[0]
        (sums * weights).sum().backward()
        grads = [p.grad.float() for p in engine.module.parameters() if p.requires_grad]
        assert len(grads) == 8 + trained_head
        found[way] = sums.detach(), grads
    for way in ("kept", "fused"):
        torch.testing.assert_close(found[way][0], found["full"][0], rtol=tolerance, atol=tolerance * 10)
        for grad, expected in zip(found[way][1], found["full"][1], strict=True):
            torch.testing.assert_close(grad, expected, rtol=tolerance * 5, atol=tolerance * 5)
