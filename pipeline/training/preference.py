"""Preference objectives over pairs of responses to one prompt (`train.objective`: dpo, orpo, simpo), as LLaMA-Factory
and TRL define them. A pair's rows carry the chosen response (`input_ids`, `labels`, the prompt labelled -100) and the
rejected one (`rejected_input_ids`, `rejected_labels`); both run in one padded batch, chosen rows first.

DPO's reference is the same model with the adapter disabled (PEFT's `disable_adapter`): no second model in memory,
and the adapter merges afterwards exactly as after SFT. It is computed in each step (`train.reference: step`), or
once before the first step for every pair the run will train on (`precomputed`: one forward less per step; the
reference never changes, since the adapter is disabled in it and the base is frozen). ORPO and SimPO need no
reference: they use the responses' mean log-probabilities (per token), DPO their sums."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from pipeline.core.imports import torch
from pipeline.data.batches import collate, on_device, shifted
from pipeline.data.examples import IGNORE_INDEX

OBJECTIVES = ("lm", "dpo", "orpo", "simpo")
FUSED_TARGET_LOGPS = "fused_target_logps"  # set on the LM by pipeline.kernels.fused_loss.install: a frozen fused head
STATS = ("pairs", "correct", "reward_chosen", "reward_rejected")  # summed over pairs, then over ranks


@dataclass(frozen=True, kw_only=True)
class Objective:
    kind: str  # one of OBJECTIVES; lm: next-token loss on the rows as they are
    beta: float  # DPO's and SimPO's reward scale; ORPO's weight of the odds-ratio term
    simpo_gamma: float  # SimPO's target reward margin
    reference: str = "step"  # DPO: step (the base, in each step) | precomputed (the base, once) | initial (the
    # model the run starts from, train.init_adapter's, once before the first step)


def pair_batch(rows: list, pad_id: int, *, bucketed: bool = False) -> dict[str, torch.Tensor]:
    """The chosen responses of `rows`, then their rejected ones, right-padded into one batch of 2 x len(rows) (with
    `bucketed`, to one of a few widths: data.batches.bucketed_width)."""
    chosen = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    rejected = [{"input_ids": r["rejected_input_ids"], "labels": r["rejected_labels"]} for r in rows]
    return collate(chosen + rejected, pad_id, bucketed=bucketed)


def response_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled next tokens (fp32), and how many there are, under `model` (a
    DeepSpeed engine or a module). Never the whole batch's logits: the fused head where the kernels installed it and it
    is frozen (a chunk of positions at a time), else transformers' logits at the labelled positions only
    (`logits_to_keep`; a trained head's gradient needs them)."""
    targets = shifted(batch["labels"])
    keep = targets != IGNORE_INDEX
    lm = _causal_lm(model)
    if getattr(lm, FUSED_TARGET_LOGPS, False):  # rows x positions, 0 where the label does not count
        per_position = model(input_ids=batch["input_ids"], labels=batch["labels"], target_logps=True).logps
        return per_position.sum(-1), keep.sum(-1)
    if _keeps_logits(type(lm)):
        logits = model(input_ids=batch["input_ids"], logits_to_keep=keep).logits  # [labelled positions, vocab]
    else:
        logits = model(input_ids=batch["input_ids"]).logits[keep]
    values = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[keep][:, None]).squeeze(1)
    per_position = torch.zeros(keep.shape, dtype=torch.float32, device=values.device)
    per_position[keep] = values.float()
    return per_position.sum(-1), keep.sum(-1)


@functools.cache
def _keeps_logits(causal_lm: type) -> bool:
    """Whether a causal LM class takes `logits_to_keep` (a mask of the positions to compute logits at)."""
    return "logits_to_keep" in inspect.signature(causal_lm.forward).parameters


def _causal_lm(model) -> torch.nn.Module:
    """The causal LM inside `model` (a DeepSpeed engine, a PEFT model or the LM itself)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_logps(engine, batch: dict[str, torch.Tensor], *, reference: bool = False):
    """`response_logps` of the model on `batch`; with `reference`, of the base (the adapter disabled, no gradient)."""
    if not reference:
        return response_logps(engine, batch)
    with torch.no_grad(), engine.module.disable_adapter():
        return response_logps(engine, batch)


def pair_losses(
    objective: Objective,
    *,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_count: torch.Tensor,
    rejected_count: torch.Tensor,
    reference_chosen: torch.Tensor | None = None,
    reference_rejected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and the implicit rewards of the chosen and rejected responses (detached)."""
    beta = objective.beta
    if objective.kind == "dpo":
        reward_c, reward_r = beta * (chosen - reference_chosen), beta * (rejected - reference_rejected)
        losses = -torch.nn.functional.logsigmoid(reward_c - reward_r)
    elif objective.kind == "simpo":
        reward_c, reward_r = beta * chosen / chosen_count, beta * rejected / rejected_count
        losses = -torch.nn.functional.logsigmoid(reward_c - reward_r - objective.simpo_gamma)
    elif objective.kind == "orpo":
        mean_c, mean_r = chosen / chosen_count, rejected / rejected_count
        log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
        losses = -mean_c - beta * torch.nn.functional.logsigmoid(log_odds)
        reward_c, reward_r = beta * mean_c, beta * mean_r
    else:
        raise ValueError(f"train.objective: {objective.kind!r} is not a preference objective; expected dpo|orpo|simpo")
    return losses, reward_c.detach(), reward_r.detach()


def pair_loss(
    engine,
    rows: list,
    *,
    pad_id: int,
    objective: Objective,
    reference: torch.Tensor | None = None,
    bucketed: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss of the pairs in `rows`, and STATS (fp64 sums left on the device: the loop reads them once a
    step). DPO's reference: `reference` ([pairs, 2]: chosen, rejected) where precomputed, else computed on the same
    batch."""
    known = {} if reference is None else {"reference": reference}
    batch = on_device({**pair_batch(rows, pad_id, bucketed=bucketed), **known}, engine.device)
    reference = batch.pop("reference", None)
    n = len(rows)
    logps, counts = model_logps(engine, batch)
    references = {}
    if objective.kind == "dpo":
        if reference is None:
            ref, _ = model_logps(engine, batch, reference=True)
            reference = torch.stack([ref[:n], ref[n:]], dim=1)
        reference = reference.to(device=logps.device, dtype=logps.dtype)
        references = {"reference_chosen": reference[:, 0], "reference_rejected": reference[:, 1]}
    losses, reward_c, reward_r = pair_losses(
        objective, chosen=logps[:n], rejected=logps[n:], chosen_count=counts[:n], rejected_count=counts[n:],
        **references,
    )  # fmt: skip
    stats = {
        "pairs": torch.full((), float(n), dtype=torch.float64, device=reward_c.device),  # no copy from the host
        "correct": (reward_c > reward_r).sum().double(),
        "reward_chosen": reward_c.sum().double(),
        "reward_rejected": reward_r.sum().double(),
    }
    return losses.mean(), stats


def precomputed_reference(
    engine,
    rows,
    indices: list[int],
    *,
    rank: int,
    world_size: int,
    micro: int,
    pad_id: int,
    initial: bool = False,
    bucketed: bool = False,
) -> dict[int, torch.Tensor]:
    """DPO's reference log-probabilities ([2]: chosen, rejected) of the pairs at `indices`, every (data-parallel) rank
    computing every world_size-th micro-batch of them and all ranks receiving all (one all-reduce): the base's (the
    adapter disabled), or with `initial` the model's as it is (before the first step: the adapter the run starts
    from)."""
    import deepspeed.comm as dist

    from pipeline.training import sequence_parallel

    table = torch.zeros(len(indices), 2, dtype=torch.float64, device=engine.device)
    mine = list(range(rank * micro, len(indices), world_size * micro))
    engine.eval()
    with torch.no_grad():
        for start in mine:
            positions = list(range(start, min(start + micro, len(indices))))
            batch = pair_batch([rows[indices[p]] for p in positions], pad_id, bucketed=bucketed)
            ref, _ = model_logps(engine, {k: v.to(engine.device) for k, v in batch.items()}, reference=not initial)
            table[positions] = torch.stack([ref[: len(positions)], ref[len(positions) :]], dim=1).double()
    engine.train()
    dist.all_reduce(table, group=sequence_parallel.current().data_group)  # a sequence-parallel group's ranks: once
    return {index: table[k].cpu() for k, index in enumerate(indices)}


def described(sums: dict[str, float]) -> dict[str, float]:
    """Summed STATS as the curve shows them: preference accuracy, mean rewards and their margin."""
    pairs = max(sums["pairs"], 1.0)
    chosen, rejected = sums["reward_chosen"] / pairs, sums["reward_rejected"] / pairs
    return {
        "preference_accuracy": sums["correct"] / pairs,
        "reward_chosen": chosen,
        "reward_rejected": rejected,
        "reward_margin": chosen - rejected,
    }
