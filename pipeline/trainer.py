"""The DeepSpeed training loop of one rank: resume, step, validate, checkpoint, report."""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from pipeline.atomic import atomic_path, read_json
from pipeline.checkpoints import folder
from pipeline.checkpoints.universal import link_optimizer_state, load_universal
from pipeline.checkpoints.zero_shards import MOMENTS
from pipeline.dataset import IGNORE_INDEX
from pipeline.fused_loss import shifted
from pipeline.schedule import global_batch, lr_factor, micro_batch


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


@dataclass
class History:
    """Per-step records, carried inside checkpoints so that curves survive a resume."""

    train: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)


def collate(rows: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad variable-length rows into one batch (transformers' usual form). No attention mask: with right
    padding a causal model never lets a real token see a pad, and without a mask SDPA takes its causal kernel
    instead of materialising the mask (less memory, faster)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.as_tensor(row["input_ids"])
        labels[i, :n] = torch.as_tensor(row["labels"])
    return {"input_ids": ids, "labels": labels}


def pack(rows: list, pad_id: int) -> dict[str, torch.Tensor]:
    """The micro-batch as the model trains on it: rows of one length (packed text blocks) as they are; rows of
    several lengths (SFT) end to end in one sequence without padding, positions restarting at each row (from
    which transformers builds a block-diagonal causal mask: no row sees another) and each row's next-token
    targets (its last position predicts nothing). The same loss over the same targets as `collate`'s padded
    batch, without computing the pads (tests/test_fused_loss.py). Needs the model's `use_cache` off (as
    pipeline.model loads it): transformers detects packed rows only without a cache."""
    if len({len(r["input_ids"]) for r in rows}) == 1:
        return collate(rows, pad_id)
    ids = torch.cat([torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows])[None]
    positions = torch.cat([torch.arange(len(r["input_ids"])) for r in rows])[None]
    targets = torch.cat([shifted(torch.as_tensor(r["labels"], dtype=torch.long)[None])[0] for r in rows])[None]
    # labels too: transformers' forward computes a loss only when given labels, and then takes shift_labels
    return {"input_ids": ids, "position_ids": positions, "labels": targets, "shift_labels": targets}


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """The positions of `batch` (collate's or pack's) that have a next-token target."""
    targets = batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]
    return int((targets != IGNORE_INDEX).sum())


def _to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _all_reduce_sum(values: list[float], device) -> list[float]:
    import deepspeed.comm as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def validate(engine, rows, *, rank: int, world_size: int, micro: int, pad_id: int) -> tuple[float, int]:
    """Token-weighted validation loss over every row (ranks take turns; all run the same number of forwards)."""
    n = len(rows)
    per_rank = math.ceil(n / world_size)
    loss_sum, tokens = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for start in range(0, per_rank, micro):
            indices = [rank + world_size * i for i in range(start, min(start + micro, per_rank))]
            real = [i for i in indices if i < n]
            batch = _to(pack([rows[i] for i in (real or [0])], pad_id), engine.device)
            loss = engine(**batch).loss.float()
            count = target_count(batch) if real else 0
            loss_sum += float(loss) * count
            tokens += count
    engine.train()
    loss_sum, tokens = _all_reduce_sum([loss_sum, float(tokens)], engine.device)
    return loss_sum / max(tokens, 1.0), int(tokens)


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


def per_rank(value: float, device) -> list[float]:
    """`value` of every rank, in rank order (a collective)."""
    import deepspeed.comm as dist

    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(v) for v in every]


def memory_peaks(device) -> dict[str, list[float]]:
    """Each rank's peak resident host memory (MB) so far, and on a GPU its peak allocated GPU memory (a collective)."""
    peaks = {"host": per_rank(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, device)}
    if str(device).startswith("cuda"):
        peaks["gpu"] = per_rank(torch.cuda.max_memory_allocated(device) / 2**20, device)
    return peaks


def resume(*, engine, directory: Path, resume_from: Path | None, universal: Path | None, seed: int) -> dict | None:
    """Load what the run continues from into `engine` and return its trainer state (None: a fresh start): the
    universal checkpoint of another layout when given (each rank's RNG is then reseeded from the seed, step and
    rank: per-rank streams do not map across world sizes), else the newest complete checkpoint of `directory`,
    else of `resume_from`."""
    import deepspeed.comm as dist

    rank = dist.get_rank()
    if universal is not None:
        load_universal(engine, universal)
        saved = read_json(universal / folder.STATE)
        folder.seed_rng(seed * 1_000_003 + saved["step"] * 1_009 + rank)
        return saved
    source = directory if folder.latest_tag(directory) else resume_from
    if source is None or (tag := folder.latest_tag(source)) is None:
        return None
    engine.load_checkpoint(str(source), tag=tag, load_module_strict=False)
    folder.set_rng_state(torch.load(folder.rng_file(source, tag, rank), weights_only=False))
    return folder.read_state(source, tag)


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
    run_state: dict,
    saved: dict | None,
    reporting: Reporting,
) -> dict:
    """Train from the step `resume` returned (None: step 0) to `schedule.max_steps`; returns the run's metrics
    (`reporting.describe` of the summary). Seconds, tokens and peak memory accumulate over resumed segments, and
    the final checkpoint keeps the metrics: a run that finds it already final returns them, marked as such."""
    import deepspeed.comm as dist

    if saved is not None and saved["step"] >= schedule.max_steps and saved.get("metrics"):
        return {**saved["metrics"], "reused_checkpoint": folder.tag_for(saved["step"])}
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accumulation = schedule.micro_batch_size, schedule.accumulation
    global_size = micro * accumulation * world
    history, start, tokens, train_seconds, wall_before, peaks_before = History(), 0, 0.0, 0.0, 0.0, {}
    if saved is not None:
        start, history = saved["step"], History(**saved["history"])
        tokens, train_seconds = saved["tokens_seen"], saved["train_seconds"]
        wall_before, peaks_before = saved.get("wall_seconds", 0.0), saved.get("memory_peaks_mb", {})
    begin = time.perf_counter()
    engine.train()  # from_pretrained leaves the module in eval mode: no dropout, no gradient checkpointing
    for step in range(start, schedule.max_steps):
        tick = time.perf_counter()
        batch_rows = global_batch(step, n_rows=len(train_rows), global_batch_size=global_size, seed=schedule.seed)
        loss_sum, step_tokens, lr = 0.0, 0, engine.get_lr()[0]
        for index in range(accumulation):
            indices = micro_batch(batch_rows, rank=rank, world_size=world, micro=micro, index=index)
            rows = [train_rows[i] for i in indices]
            batch = _to(pack(rows, pad_id), engine.device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach().float())
            step_tokens += sum(len(row["input_ids"]) for row in rows)
        loss_total, tokens_total = _all_reduce_sum([loss_sum, float(step_tokens)], engine.device)
        train_seconds += time.perf_counter() - tick
        tokens += tokens_total
        last_loss = loss_total / (accumulation * world)
        record = {"step": step + 1, "loss": last_loss, "lr": lr}
        history.train.append(record)
        done = step + 1 == schedule.max_steps
        if (step + 1) % schedule.eval_every == 0 or done:
            subset = [val_rows[i] for i in range(min(len(val_rows), schedule.eval_max_rows or len(val_rows)))]
            val_loss, _ = validate(engine, subset, rank=rank, world_size=world, micro=micro, pad_id=pad_id)
            entry = {"step": step + 1, "val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
            history.validation.append(entry)
            record = {**record, **entry}
        throughput = tokens / max(train_seconds, 1e-9)
        reporting.log({**record, "tokens_per_s": throughput}, step + 1)
        reporting.progress(step + 1, {"loss": last_loss, "lr": record["lr"], "tok/s": throughput})
        if (step + 1) % schedule.save_every == 0 or done:
            peaks = _with_earlier(memory_peaks(engine.device), peaks_before)
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
            if done:
                figures = _summary(history, schedule.max_steps, start, tokens, train_seconds, wall, peaks)
                state["metrics"] = metrics = reporting.describe(figures)
            folder.save(
                engine=engine,
                directory=directory,
                step=step + 1,
                state=state,
                tokenizer_dir=tokenizer_dir,
                keep_last=schedule.keep_last,
            )
    if start >= schedule.max_steps:  # a final checkpoint written before checkpoints kept their metrics
        figures = _summary(history, start, start, tokens, train_seconds, None, {})
        metrics = {**reporting.describe(figures), "reused_checkpoint": folder.tag_for(start)}
    return {**metrics, "history": history.__dict__}


def _with_earlier(peaks: dict[str, list[float]], earlier: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-rank peaks over this segment and the earlier ones of the run (same world size), else this segment's."""
    merged = {}
    for kind, values in peaks.items():
        before = earlier.get(kind, [])
        same_world = len(before) == len(values)
        merged[kind] = [max(a, b) for a, b in zip(values, before, strict=True)] if same_world else values
    return merged


def _summary(
    history: History, steps: int, start: int, tokens: float, seconds: float, wall: float | None, peaks: dict
) -> dict:
    """The loop's figures (None where unknown)."""
    validation = history.validation[-1] if history.validation else {}
    figures = {
        "steps": steps,
        "resumed_from_step": start,
        "final_train_loss": history.train[-1]["loss"] if history.train else None,
        "val_loss": validation.get("val_loss"),
        "val_perplexity": validation.get("val_perplexity"),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "train_seconds": seconds,
        "wall_seconds": wall,
        "peak_memory_mb": max(peaks["host"]) if "host" in peaks else None,
        "peak_memory_mb_per_rank": peaks.get("host"),
    }
    if "gpu" in peaks:
        figures.update(peak_gpu_memory_mb=max(peaks["gpu"]), peak_gpu_memory_mb_per_rank=peaks["gpu"])
    return figures


def lr_scheduler_factory(schedule: Schedule) -> Callable:
    """What deepspeed.initialize calls with its optimizer: a LambdaLR saved and restored with checkpoints."""
    factor = partial(
        lr_factor, warmup_steps=schedule.warmup_steps, total_steps=schedule.max_steps, kind=schedule.lr_scheduler
    )
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16


def mfu(*, tokens_per_s: float, n_params: int, model_config, seq_len: int, world: int, device) -> float | None:
    """Model FLOPs utilisation on a GPU with the LoRA convention: 4N per token (forward, and backward through
    frozen weights) plus attention, 12 x layers x hidden x sequence; None on the CPU or an unknown GPU."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        return None
    flops_per_token = 4 * n_params + 12 * model_config.num_hidden_layers * model_config.hidden_size * seq_len
    return round(tokens_per_s * flops_per_token / (peak * 1e12 * world), 4)


def write_curve(path: Path, history: dict) -> None:
    """One CSV row per step: loss and LR, validation figures where measured (a DVC plot)."""
    validation = {v["step"]: v for v in history["validation"]}
    lines = ["step,loss,lr,val_loss,val_perplexity"]
    for row in history["train"]:
        v = validation.get(row["step"], {})
        lines.append(
            f"{row['step']},{row['loss']:.6f},{row['lr']:.6g},{v.get('val_loss', '')},{v.get('val_perplexity', '')}"
        )
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
