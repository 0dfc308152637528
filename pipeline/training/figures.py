"""A run's figures: per-rank values gathered, peak memory, model FLOPs utilisation, the run's summary and its
per-step curve."""

from __future__ import annotations

import resource
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.core.imports import torch


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


def with_earlier(peaks: dict[str, list[float]], earlier: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-rank peaks over this segment and the earlier ones of the run (same world size), else this segment's."""
    merged = {}
    for kind, values in peaks.items():
        before = earlier.get(kind, [])
        same_world = len(before) == len(values)
        merged[kind] = [max(a, b) for a, b in zip(values, before, strict=True)] if same_world else values
    return merged


def summary(history, steps: int, start: int, tokens: float, seconds: float, wall: float | None, peaks: dict) -> dict:
    """The loop's figures from its `History` (None where unknown)."""
    validation = history.validation[-1] if history.validation else {}
    figures = {
        "steps": steps,
        "resumed_from_step": start,
        "final_train_loss": history.train[-1]["loss"] if history.train else None,
        "val_loss": validation.get("val_loss"),
        "val_perplexity": validation.get("val_perplexity"),
        **{k: v for k, v in validation.items() if k.startswith("val_") and k not in ("val_loss", "val_perplexity")},
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "train_seconds": seconds,
        "wall_seconds": wall,
        "peak_memory_mb": max(peaks["host"]) if "host" in peaks else None,
        "peak_memory_mb_per_rank": peaks.get("host"),
    }
    if "gpu" in peaks:
        figures.update(peak_gpu_memory_mb=max(peaks["gpu"]), peak_gpu_memory_mb_per_rank=peaks["gpu"])
    return figures


# Dense bf16 TFLOPS by device name, the first pattern found in it wins: the PCIe and NVL H100s run lower clocks
# (and the NVL fewer SMs) than the SXM card whose 989 a bare "H100" gets; "A100" and "H200" before "A10" and "H20".
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("L40S", 362.0), ("A10", 125.0),
)  # fmt: skip


def peak_tflops(name: str) -> float | None:
    """The dense bf16 peak of a device named `name` (torch.cuda.get_device_name), None if unknown."""
    return next((peak for pattern, peak in PEAK_TFLOPS if pattern in name), None)


def flops_per_token(*, n_params: int, model_config, seq_len: int) -> float:
    """Training FLOPs per token with LoRA: 4 x the parameters that multiply (forward, and backward through frozen
    weights; the input embedding is a lookup, so an untied one does not count, a tied head does) plus causal
    attention, 6 x layers x hidden x sequence (QK^T and AV over half the positions, forward and backward)."""
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    lookup = 0 if getattr(model_config, "tie_word_embeddings", False) else vocab * hidden
    return 4 * (n_params - lookup) + 6 * model_config.num_hidden_layers * hidden * seq_len


def mfu(*, tokens_per_s: float, n_params: int, model_config, seq_len: int, world: int, device) -> float | None:
    """Model FLOPs utilisation on a GPU (`flops_per_token` over the device's peak); None on the CPU or an unknown
    GPU."""
    if not str(device).startswith("cuda"):
        return None
    peak = peak_tflops(torch.cuda.get_device_name(device))
    if peak is None:
        return None
    per_token = flops_per_token(n_params=n_params, model_config=model_config, seq_len=seq_len)
    return round(tokens_per_s * per_token / (peak * 1e12 * world), 4)


def write_curve(path: Path, history: dict) -> None:
    """One CSV row per step: loss and LR, validation figures where measured, and what else the objective records
    (preference accuracy and rewards) after them (a DVC plot)."""
    validation = {v["step"]: v for v in history["validation"]}
    columns = ["loss", "lr", "val_loss", "val_perplexity"]
    for record in (*history["train"], *history["validation"]):
        columns += [key for key in record if key != "step" and key not in columns]
    lines = [",".join(["step", *columns])]
    for row in history["train"]:
        values = {**validation.get(row["step"], {}), **row}
        lines.append(",".join([str(row["step"]), *(_cell(key, values.get(key)) for key in columns)]))
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")


CURVE_FORMATS = {"loss": "{:.6f}", "lr": "{:.6g}"}  # the rest as Python writes them; empty where not measured


def _cell(key: str, value) -> str:
    return "" if value is None else CURVE_FORMATS.get(key, "{}").format(value)
