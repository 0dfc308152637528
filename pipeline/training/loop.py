"""The DeepSpeed training loop of one rank: resume, step, validate, checkpoint, report."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.checkpoints import folder
from pipeline.checkpoints.universal import link_optimizer_state
from pipeline.checkpoints.zero_shards import MOMENTS
from pipeline.data.batches import pack, target_count
from pipeline.training import figures, sequence_parallel
from pipeline.training.preference import STATS, Objective, described, pair_loss, precomputed_reference
from pipeline.training.profile import profiled_steps
from pipeline.training.schedule import Schedule, global_batch, micro_batch


@dataclass
class History:
    """Per-step records, carried inside checkpoints so that curves survive a resume."""

    train: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _all_reduce_sum(values: list[float], device) -> list[float]:
    """Summed over the data-parallel ranks (sequence parallelism: one rank per group, each holding its group's)."""
    import deepspeed.comm as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=sequence_parallel.current().data_group)
    return tensor.tolist()


def validate(
    engine, rows, *, rank: int, world_size: int, micro: int, pad_id: int, varlen: bool = False
) -> tuple[float, int]:
    """Token-weighted validation loss over every row (ranks take turns; all run the same number of forwards)."""
    loss_sum, tokens = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for real in _turns(len(rows), rank=rank, world_size=world_size, micro=micro):
            batch = _to(pack([rows[i] for i in (real or [0])], pad_id, varlen=varlen), engine.device)
            loss = engine(**batch).loss.float()
            count = target_count(batch) if real else 0
            loss_sum += float(loss) * count
            tokens += count
    engine.train()
    loss_sum, tokens = _all_reduce_sum([loss_sum, float(tokens)], engine.device)
    return loss_sum / max(tokens, 1.0), int(tokens)


def validate_pairs(
    engine, rows, *, rank: int, world_size: int, micro: int, pad_id: int, objective: Objective
) -> dict[str, float]:
    """The mean preference loss over every pair of `rows`, with their accuracy and rewards (`described`)."""
    sums = dict.fromkeys(("loss", *STATS), 0.0)
    engine.eval()
    with torch.no_grad():
        for real in _turns(len(rows), rank=rank, world_size=world_size, micro=micro):
            loss, stats = pair_loss(engine, [rows[i] for i in (real or [0])], pad_id=pad_id, objective=objective)
            if real:
                sums["loss"] += float(loss) * len(real)
                sums.update({k: sums[k] + stats[k] for k in STATS})
    engine.train()
    totals = dict(zip(sums, _all_reduce_sum(list(sums.values()), engine.device), strict=True))
    figures = {f"val_{k}": v for k, v in described(totals).items()}
    return {"val_loss": totals["loss"] / max(totals["pairs"], 1.0), **figures}


def _turns(n: int, *, rank: int, world_size: int, micro: int):
    """This rank's micro-batches of row indices (empty where it has none left: it still runs a forward)."""
    per_rank = math.ceil(n / world_size)
    for start in range(0, per_rank, micro):
        indices = [rank + world_size * i for i in range(start, min(start + micro, per_rank))]
        yield [i for i in indices if i < n]


def _forward(engine, rows: list, *, pad_id: int, varlen: bool, objective: Objective, reference=None):
    """One micro-batch's loss, its tokens and (preference objectives) its summed STATS; `reference`: DPO's
    precomputed reference of these rows, if any."""
    if objective.kind == "lm":
        batch = _to(pack(rows, pad_id, varlen=varlen), engine.device)
        return engine(**batch).loss, sum(len(row["input_ids"]) for row in rows), {}
    loss, stats = pair_loss(engine, rows, pad_id=pad_id, objective=objective, reference=reference)
    return loss, sum(len(row["input_ids"]) + len(row["rejected_input_ids"]) for row in rows), stats


REFERENCE_KEY = "reference_logps"  # a checkpoint's precomputed DPO reference: {pair index: [chosen, rejected]}


def _saved_reference(saved: dict | None, *, fingerprint: str, initial: bool) -> dict[int, torch.Tensor] | None:
    """The precomputed reference this run's checkpoint kept (float64, as computed), if any: one of another run
    (train.resume_from) belongs to its pairs. The initial model's reference cannot be computed again once the
    adapter has trained: a resume without it is refused."""
    if saved is not None and saved.get("fingerprint") == fingerprint and REFERENCE_KEY in saved:
        return {int(i): torch.tensor(values, dtype=torch.float64) for i, values in saved[REFERENCE_KEY].items()}
    if saved is not None and initial:
        raise ValueError(
            "train.init_adapter: DPO's reference is the adapter this run started from, which the checkpoint resumed "
            "from does not keep (another run's, or written before it was kept); expected a checkpoint of this run"
        )
    return None


def gathered_trainable(engine, moments: bool = False) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full fp32 master value, and with `moments` its Adam moments under
    `NAME#exp_avg` and `NAME#exp_avg_sq` (a collective under ZeRO-3: call on all ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if moments:
        link_optimizer_state(engine)
    state = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            master = safe_get_full_fp32_param(param)  # None without a ZeRO optimizer: the module holds the value
            state[name] = (param if master is None else master).detach().float().cpu().clone()
            for key in MOMENTS if moments else ():
                state[f"{name}#{key}"] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
    return state


@dataclass(frozen=True, kw_only=True)
class Reporting:
    """How the loop reports: a step's figures to the tracker, the progress bar, and the run's final figures
    (the loop's summary -> the metrics file's content, which the final checkpoint keeps)."""

    log: Callable[[dict, int], None]
    progress: Callable[[int, dict], None]
    describe: Callable[[dict], dict]


def train(
    *,
    engine,
    train_rows,
    val_rows,
    schedule: Schedule,
    directory: Path,
    tokenizer_dir: Path,
    pad_id: int,
    varlen: bool,
    objective: Objective,
    run_state: dict,
    saved: dict | None,
    reporting: Reporting,
) -> dict:
    """Train from the step of `saved` (None: step 0; a finished run never gets here) to `schedule.max_steps`;
    returns the run's metrics (`reporting.describe` of the summary) and history. Seconds, tokens and peak memory
    accumulate over resumed segments, and the final checkpoint keeps the metrics."""
    import deepspeed.comm as dist

    layout = sequence_parallel.current()  # the ranks of a sequence-parallel group share their rows (issue 46)
    rank, world = layout.data_rank, layout.data_world
    micro, accumulation = schedule.micro_batch_size, schedule.accumulation
    global_size = micro * accumulation * world
    history, start, tokens, train_seconds, wall_before, peaks_before = History(), 0, 0.0, 0.0, 0.0, {}
    if saved is not None:
        start, history = saved["step"], History(**saved["history"])
        tokens, train_seconds = saved["tokens_seen"], saved["train_seconds"]
        wall_before, peaks_before = saved.get("wall_seconds", 0.0), saved.get("memory_peaks_mb", {})
    begin, first = time.perf_counter(), None  # first: (tokens, seconds) after this segment's first step (warm-up)
    reference = None  # DPO's precomputed reference: computed before the first step, kept in every checkpoint
    if objective.kind == "dpo" and objective.reference != "step":
        initial = objective.reference == "initial"
        reference = _saved_reference(saved, fingerprint=run_state["fingerprint"], initial=initial)
        if reference is None:
            order = (global_batch(s, n_rows=len(train_rows), global_batch_size=global_size, seed=schedule.seed) for s
                     in range(start, schedule.max_steps))  # fmt: skip
            needed = sorted({int(i) for batch in order for i in batch})
            reference = precomputed_reference(
                engine, train_rows, needed, rank=rank, world_size=world, micro=micro, pad_id=pad_id, initial=initial
            )
    engine.train()  # from_pretrained leaves the module in eval mode: no dropout, no gradient checkpointing
    with profiled_steps(rank=dist.get_rank()) as profile_step:
        for step in range(start, schedule.max_steps):
            tick = time.perf_counter()
            batch_rows = global_batch(step, n_rows=len(train_rows), global_batch_size=global_size, seed=schedule.seed)
            loss_sum, step_tokens, lr = 0.0, 0, engine.get_lr()[0]
            sums = dict.fromkeys(STATS if objective.kind != "lm" else (), 0.0)
            for index in range(accumulation):
                indices = micro_batch(batch_rows, rank=rank, world_size=world, micro=micro, index=index)
                rows = [train_rows[i] for i in indices]
                known = None if reference is None else torch.stack([reference[i] for i in indices])
                loss, row_tokens, stats = _forward(
                    engine, rows, pad_id=pad_id, varlen=varlen, objective=objective, reference=known
                )
                engine.backward(loss)
                engine.step()
                loss_sum += float(loss.detach().float())
                step_tokens += row_tokens
                sums.update({k: sums[k] + stats[k] for k in sums})
            loss_total, tokens_total, *summed = _all_reduce_sum(
                [loss_sum, float(step_tokens), *sums.values()], engine.device
            )
            train_seconds += time.perf_counter() - tick
            tokens += tokens_total
            first = first or (tokens, train_seconds)
            last_loss = loss_total / (accumulation * world)
            record = {"step": step + 1, "loss": last_loss, "lr": lr}
            if sums:
                record |= described(dict(zip(sums, summed, strict=True)))
            history.train.append(record)
            done = step + 1 == schedule.max_steps
            if (step + 1) % schedule.eval_every == 0 or done:
                subset = [val_rows[i] for i in range(min(len(val_rows), schedule.eval_max_rows or len(val_rows)))]
                turns = {"rank": rank, "world_size": world, "micro": micro, "pad_id": pad_id}
                if objective.kind == "lm":
                    val_loss, _ = validate(engine, subset, **turns, varlen=varlen)
                    entry = {"step": step + 1, "val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
                else:
                    entry = {"step": step + 1, **validate_pairs(engine, subset, **turns, objective=objective)}
                history.validation.append(entry)
                record = {**record, **entry}
            throughput = tokens / max(train_seconds, 1e-9)
            reporting.log({**record, "tokens_per_s": throughput}, step + 1)
            reporting.progress(step + 1, {"loss": last_loss, "lr": record["lr"], "tok/s": throughput})
            if (step + 1) % schedule.save_every == 0 or done:
                peaks = figures.with_earlier(figures.memory_peaks(engine.device), peaks_before)
                wall = wall_before + time.perf_counter() - begin
                state = {
                    **run_state,
                    "step": step + 1,
                    "history": history.__dict__,
                    "tokens_seen": tokens,
                    "train_seconds": train_seconds,
                    "wall_seconds": wall,
                    "memory_peaks_mb": peaks,
                }
                if reference is not None:
                    state[REFERENCE_KEY] = {str(i): values.tolist() for i, values in reference.items()}
                if done:
                    summary = figures.summary(history, schedule.max_steps, start, tokens, train_seconds, wall, peaks)
                    steady = train_seconds - first[1]  # without the first step: CUDA and cuBLAS start in it
                    summary["steady_tokens_per_s"] = (
                        (tokens - first[0]) / steady if step > start and steady > 0 else None
                    )
                    state["metrics"] = metrics = reporting.describe(summary)
                folder.save(
                    engine=engine,
                    directory=directory,
                    step=step + 1,
                    state=state,
                    tokenizer_dir=tokenizer_dir,
                    keep_last=schedule.keep_last,
                )
            profile_step()
    return {**metrics, "history": history.__dict__}
