"""The DeepSpeed training loop of one rank, read top to bottom in `train`: DPO's reference, then per optimizer step
`train_step` (`accumulate`: the micro-batches' forward and backward), `validation`, `report`, `checkpoint`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.checkpoints import folder
from pipeline.checkpoints.universal import link_optimizer_state
from pipeline.checkpoints.zero_shards import MOMENTS
from pipeline.data.batches import on_device, pack, target_count
from pipeline.kernels import compiled_layers
from pipeline.training import figures, sequence_parallel
from pipeline.training.preference import STATS, Objective, described, pair_loss, precomputed_reference
from pipeline.training.profile import profiled_steps
from pipeline.training.schedule import Schedule, global_batch, micro_batch

if TYPE_CHECKING:
    from pipeline.training.plan import RunState


@dataclass
class History:
    """Per-step records, carried inside checkpoints so that curves survive a resume."""

    train: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)


def _all_reduce_sum(values: list, device) -> list[float]:
    """Each value (a number, or a 0-dim tensor still on the device) summed over the data-parallel ranks (sequence
    parallelism: one rank per group, each holding its group's): one all-reduce, one read back to the host."""
    import deepspeed.comm as dist

    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    dist.all_reduce(tensor, group=sequence_parallel.current().data_group)
    return tensor.tolist()


def validate(
    engine, rows, *, rank: int, world_size: int, micro: int, pad_id: int, varlen: bool = False, bucketed: bool = False
) -> tuple[float, int]:
    """Token-weighted validation loss over every row (ranks take turns; all run the same number of forwards)."""
    loss_sum, tokens = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for real in _turns(len(rows), rank=rank, world_size=world_size, micro=micro):
            packed = pack([rows[i] for i in (real or [0])], pad_id, varlen=varlen, bucketed=bucketed)
            batch = on_device(packed, engine.device)
            loss = engine(**batch).loss.float()
            count = target_count(batch) if real else 0
            loss_sum += float(loss) * count
            tokens += count
    engine.train()
    loss_sum, tokens = _all_reduce_sum([loss_sum, float(tokens)], engine.device)
    return loss_sum / max(tokens, 1.0), int(tokens)


def validate_pairs(
    engine, rows, *, rank: int, world_size: int, micro: int, pad_id: int, objective: Objective, bucketed: bool = False
) -> dict[str, float]:
    """The mean preference loss over every pair of `rows`, with their accuracy and rewards (`described`)."""
    sums = dict.fromkeys(("loss", *STATS), 0.0)
    engine.eval()
    with torch.no_grad():
        for real in _turns(len(rows), rank=rank, world_size=world_size, micro=micro):
            pairs = [rows[i] for i in (real or [0])]
            loss, stats = pair_loss(engine, pairs, pad_id=pad_id, objective=objective, bucketed=bucketed)
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


def _forward(engine, rows: list, *, pad_id: int, varlen: bool, bucketed: bool, objective: Objective, reference=None):
    """One micro-batch's loss, its tokens and (preference objectives) its summed STATS; `reference`: DPO's
    precomputed reference of these rows, if any."""
    if objective.kind == "lm":
        batch = on_device(pack(rows, pad_id, varlen=varlen, bucketed=bucketed), engine.device)
        return engine(**batch).loss, sum(len(row["input_ids"]) for row in rows), {}
    loss, stats = pair_loss(engine, rows, pad_id=pad_id, objective=objective, reference=reference, bucketed=bucketed)
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


@dataclass(frozen=True, kw_only=True)
class Loop:
    """What every step of one rank's loop uses: the engine, the rows, the schedule and objective, the rank's place
    among the data-parallel ranks (`rank` of `world`: the ranks of a sequence-parallel group share their rows)."""

    engine: object
    train_rows: object
    val_rows: object
    schedule: Schedule
    objective: Objective
    pad_id: int
    varlen: bool
    bucketed: bool  # batches padded to a few widths (data.batches.bucketed_width): static shapes for compiled layers
    rank: int
    world: int

    @property
    def global_size(self) -> int:
        """Rows per optimizer step, over every rank."""
        return self.schedule.micro_batch_size * self.schedule.accumulation * self.world

    def batch(self, step: int) -> list[int]:
        """The row indices of `step`'s global batch (a pure function of the step and the seed)."""
        n_rows, seed = len(self.train_rows), self.schedule.seed
        return global_batch(step, n_rows=n_rows, global_batch_size=self.global_size, seed=seed)


@dataclass
class Progress:
    """Where the run stands, carried from step to step and, inside checkpoints, across resumed segments: the
    history, tokens and seconds trained, and the earlier segments' wall time and peak memory."""

    start: int = 0
    history: History = field(default_factory=History)
    tokens: float = 0.0
    train_seconds: float = 0.0
    wall_before: float = 0.0
    peaks_before: dict = field(default_factory=dict)
    begin: float = field(default_factory=time.perf_counter)
    first: tuple[float, float] | None = None  # (tokens, seconds) after this segment's warm-up: its first step, and
    # any later one that compiled a graph (a new width of DPO's pairs)

    def add_step(self, tokens: float, seconds: float, *, compiled: bool) -> None:
        """Count a step of `tokens` trained in `seconds`; one that `compiled` a graph is a warm-up step, as the
        segment's first is."""
        self.tokens += tokens
        self.train_seconds += seconds
        if self.first is None or compiled:
            self.first = (self.tokens, self.train_seconds)

    def steady_tokens_per_s(self) -> float | None:
        """Tokens a second over the steps after the warm-up; None where none came after it."""
        if self.first is None or self.train_seconds <= self.first[1]:
            return None
        return (self.tokens - self.first[0]) / (self.train_seconds - self.first[1])

    @classmethod
    def resumed(cls, saved: dict | None) -> Progress:
        """From the trainer state of the checkpoint the run resumes from (None: step 0)."""
        if saved is None:
            return cls()
        return cls(
            start=saved["step"],
            history=History(**saved["history"]),
            tokens=saved["tokens_seen"],
            train_seconds=saved["train_seconds"],
            wall_before=saved.get("wall_seconds", 0.0),
            peaks_before=saved.get("memory_peaks_mb", {}),
        )


def train(
    loop: Loop, *, run_state: RunState, saved: dict | None, directory: Path, tokenizer_dir: Path, reporting: Reporting
) -> dict:
    """Train from the step of `saved` (None: step 0; a finished run never gets here) to the schedule's last step,
    checkpointing into `directory`; returns the run's metrics (`reporting.describe` of the summary) and history.
    Seconds, tokens and peak memory accumulate over resumed segments, and the final checkpoint keeps the metrics."""
    schedule = loop.schedule
    progress = Progress.resumed(saved)
    reference = dpo_reference(loop, saved=saved, start=progress.start, fingerprint=run_state.fingerprint)
    saving = {"run_state": run_state, "directory": directory, "tokenizer_dir": tokenizer_dir, "reporting": reporting}
    import deepspeed.comm as dist

    loop.engine.train()  # from_pretrained leaves the module in eval mode: no dropout, no gradient checkpointing
    with profiled_steps(rank=dist.get_rank()) as profile_step:
        for step in range(progress.start + 1, schedule.max_steps + 1):  # the optimizer step each iteration ends
            record = train_step(loop, step, reference=reference, progress=progress)
            done = step == schedule.max_steps
            if step % schedule.eval_every == 0 or done:
                record = {**record, **validation(loop, step, history=progress.history)}
            report(reporting, record, progress)
            if step % schedule.save_every == 0 or done:
                metrics = checkpoint(loop, step, progress=progress, reference=reference, **saving)
            profile_step()
    return {**metrics, "history": progress.history.__dict__}


def dpo_reference(loop: Loop, *, saved: dict | None, start: int, fingerprint: str) -> dict[int, torch.Tensor] | None:
    """DPO's precomputed reference log-probabilities of every pair the remaining steps train on: those the
    checkpoint kept, else computed now, before the first step; None for other objectives and `reference: step`."""
    objective, schedule = loop.objective, loop.schedule
    if objective.kind != "dpo" or objective.reference == "step":
        return None
    initial = objective.reference == "initial"
    reference = _saved_reference(saved, fingerprint=fingerprint, initial=initial)
    if reference is None:
        needed = sorted({int(i) for step in range(start, schedule.max_steps) for i in loop.batch(step)})
        turns = {"rank": loop.rank, "world_size": loop.world, "micro": schedule.micro_batch_size, "pad_id": loop.pad_id}
        reference = precomputed_reference(
            loop.engine, loop.train_rows, needed, **turns, initial=initial, bucketed=loop.bucketed
        )
    return reference


def train_step(loop: Loop, step: int, *, reference: dict | None, progress: Progress) -> dict:
    """Optimizer step `step` (from 1): this rank's micro-batches (`accumulate`), their loss, tokens and figures
    summed over the world; the step's record, kept in the history."""
    tick, graphs = time.perf_counter(), compiled_layers.graphs()
    lr = loop.engine.get_lr()[0]
    loss_sum, step_tokens, sums = accumulate(loop, loop.batch(step - 1), reference=reference)
    loss_total, tokens_total, *summed = _all_reduce_sum(
        [loss_sum, float(step_tokens), *sums.values()], loop.engine.device
    )
    progress.add_step(tokens_total, time.perf_counter() - tick, compiled=compiled_layers.graphs() != graphs)
    record = {"step": step, "loss": loss_total / (loop.schedule.accumulation * loop.world), "lr": lr}
    if sums:
        record |= described(dict(zip(sums, summed, strict=True)))
    progress.history.train.append(record)
    return record


def accumulate(loop: Loop, batch_rows: list[int], *, reference: dict | None) -> tuple[torch.Tensor, int, dict]:
    """This rank's micro-batches of a global batch, each forward and backward (DeepSpeed steps the optimizer at the
    last); their summed loss and (preference objectives) STATS on the device (read once a step, with the all-reduce),
    and their tokens."""
    engine, micro = loop.engine, loop.schedule.micro_batch_size
    loss_sum, step_tokens = torch.zeros((), device=engine.device), 0
    sums = dict.fromkeys(STATS if loop.objective.kind != "lm" else (), 0.0)
    scale = sequence_parallel.current().gradient_scale  # ZeRO-3 under sequence parallelism: see that module
    for index in range(loop.schedule.accumulation):
        indices = micro_batch(batch_rows, rank=loop.rank, world_size=loop.world, micro=micro, index=index)
        rows = [loop.train_rows[i] for i in indices]
        known = None if reference is None else torch.stack([reference[i] for i in indices])
        loss, row_tokens, stats = _forward(
            engine,
            rows,
            pad_id=loop.pad_id,
            varlen=loop.varlen,
            bucketed=loop.bucketed,
            objective=loop.objective,
            reference=known,
        )
        engine.backward(loss if scale == 1 else loss * scale)
        engine.step()
        loss_sum += loss.detach().float()
        step_tokens += row_tokens
        sums.update({k: sums[k] + stats[k] for k in sums})
    return loss_sum, step_tokens, sums


def validation(loop: Loop, step: int, *, history: History) -> dict:
    """The validation figures after `step` on the first `eval_max_rows` validation rows, kept in the history."""
    rows, schedule = loop.val_rows, loop.schedule
    subset = [rows[i] for i in range(min(len(rows), schedule.eval_max_rows or len(rows)))]
    turns = {"rank": loop.rank, "world_size": loop.world, "micro": schedule.micro_batch_size, "pad_id": loop.pad_id}
    if loop.objective.kind == "lm":
        val_loss, _ = validate(loop.engine, subset, **turns, varlen=loop.varlen, bucketed=loop.bucketed)
        entry = {"step": step, "val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
    else:
        pairs = validate_pairs(loop.engine, subset, **turns, objective=loop.objective, bucketed=loop.bucketed)
        entry = {"step": step, **pairs}
    history.validation.append(entry)
    return entry


def report(reporting: Reporting, record: dict, progress: Progress) -> None:
    """A step's figures to the tracker and the progress bar, with the throughput so far."""
    throughput = progress.tokens / max(progress.train_seconds, 1e-9)
    reporting.log({**record, "tokens_per_s": throughput}, record["step"])
    reporting.progress(record["step"], {"loss": record["loss"], "lr": record["lr"], "tok/s": throughput})


def checkpoint(
    loop: Loop,
    step: int,
    *,
    progress: Progress,
    run_state: RunState,
    reference: dict | None,
    directory: Path,
    tokenizer_dir: Path,
    reporting: Reporting,
) -> dict | None:
    """The checkpoint after `step`: every rank's shards, and the trainer state (the run's identity, the history and
    figures so far, DPO's reference); after the last step also the run's metrics, which it returns."""
    peaks = figures.with_earlier(figures.memory_peaks(loop.engine.device), progress.peaks_before)
    wall = progress.wall_before + time.perf_counter() - progress.begin
    state = {
        **run_state.saved(),
        "step": step,
        "history": progress.history.__dict__,
        "tokens_seen": progress.tokens,
        "train_seconds": progress.train_seconds,
        "wall_seconds": wall,
        "memory_peaks_mb": peaks,
    }
    if reference is not None:
        state[REFERENCE_KEY] = {str(i): values.tolist() for i, values in reference.items()}
    metrics = None
    if step == loop.schedule.max_steps:
        state["metrics"] = metrics = reporting.describe(final_summary(progress, wall=wall, peaks=peaks, steps=step))
    keep = loop.schedule.keep_last
    folder.save(
        engine=loop.engine, directory=directory, step=step, state=state, tokenizer_dir=tokenizer_dir, keep_last=keep
    )
    return metrics


def final_summary(progress: Progress, *, wall: float, peaks: dict, steps: int) -> dict:
    """The run's figures at its last step; the steady throughput leaves out this segment's warm-up (its first step,
    where CUDA and cuBLAS start, and every step that compiled a graph), None where no step came after it."""
    p = progress
    summary = figures.summary(p.history, steps, p.start, p.tokens, p.train_seconds, wall, peaks)
    summary["steady_tokens_per_s"] = p.steady_tokens_per_s()
    return summary
