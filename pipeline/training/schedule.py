"""Data order and learning-rate schedule as pure functions of the step, so that a resume needs only the step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

from pipeline.core.imports import torch


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What the loop needs to know about steps and batches."""

    micro_batch_size: int
    accumulation: int
    max_steps: int
    warmup_steps: int
    lr_scheduler: str
    eval_every: int
    eval_max_rows: int
    save_every: int
    keep_last: int
    seed: int


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the peak LR at optimizer step `step`: linear warmup, then cosine/linear decay to 0."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress


def steps_per_epoch(n_rows: int, global_batch: int) -> int:
    """Full global batches per pass over the data (the last partial one is dropped)."""
    if n_rows < global_batch:
        raise ValueError(
            f"train.global_batch_size: {global_batch} exceeds the {n_rows} training rows; lower it or add data"
        )
    return n_rows // global_batch


def global_batch(step: int, *, n_rows: int, global_batch_size: int, seed: int) -> torch.Tensor:
    """Row indices of optimizer step `step`: a seeded permutation per epoch, cut into global batches."""
    per_epoch = steps_per_epoch(n_rows, global_batch_size)
    epoch, position = divmod(step, per_epoch)
    return epoch_order(n_rows, seed, epoch)[position * global_batch_size : (position + 1) * global_batch_size]


@lru_cache(maxsize=1)
def epoch_order(n_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded permutation of one epoch, drawn once per epoch (tens of millions of rows take a second) and held as
    int32 where the rows fit (half the memory; torch draws the same permutation for either dtype)."""
    dtype = torch.int32 if n_rows < 2**31 else torch.int64
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch), dtype=dtype)


def micro_batch(batch: torch.Tensor, *, rank: int, world_size: int, micro: int, index: int) -> list[int]:
    """Rows of micro-batch `index` of `rank`: the same global batch is covered whatever the world size."""
    start = (index * world_size + rank) * micro
    return batch[start : start + micro].tolist()


def lr_scheduler_factory(schedule: Schedule) -> Callable:
    """What deepspeed.initialize calls with its optimizer: a LambdaLR saved and restored with checkpoints."""
    factor = partial(
        lr_factor, warmup_steps=schedule.warmup_steps, total_steps=schedule.max_steps, kind=schedule.lr_scheduler
    )
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
