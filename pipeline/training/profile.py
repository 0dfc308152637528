"""An opt-in torch profiler over a few training steps, for finding where a GPU step's time goes.

`PIPELINE_PROFILE=DIR` (set by `bench.gpu_train`): each rank profiles steps 3 and 4 of its segment (the first two
warm up) and writes the operators by their own device time to DIR/profile_rank{R}.txt, and on a GPU DIR/SUMMARY: the
kernels launched, the GPU's busy time and the step's wall time, per step (the GPU's idle time is their difference).
On a GPU it records CUDA activity only (no host-side operator records, which would slow the host it measures).
Unset, it costs nothing."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

VARIABLE = "PIPELINE_PROFILE"
SUMMARY = "profile_summary.json"
ROWS = 40
ACTIVE = 2  # steps profiled, after one waited and one warmed up


def step_summary(averages, *, wall_seconds: float, steps: int) -> dict[str, float]:
    """Per step: kernels launched, the GPU's busy and idle milliseconds and the wall milliseconds."""
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1000 / steps
    wall_ms = wall_seconds * 1000 / steps
    return {
        "kernels_per_step": round(sum(e.count for e in kernels) / steps),
        "gpu_busy_ms_per_step": round(busy_ms, 1),
        "wall_ms_per_step": round(wall_ms, 1),
        "gpu_idle_ms_per_step": round(max(wall_ms - busy_ms, 0.0), 1),
    }


@contextlib.contextmanager
def profiled_steps(*, rank: int) -> Iterator[callable]:
    """Yields the function to call after each step; profiles only where PIPELINE_PROFILE names a folder."""
    folder = os.environ.get(VARIABLE)
    if not folder:
        yield lambda: None
        return
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    marks: list[float] = []  # the wall clock as each step ends

    def write(prof) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        table = averages.table(sort_by=sort, row_limit=ROWS, max_name_column_width=70)
        Path(folder, f"profile_rank{rank}.txt").write_text(table)
        if cuda and rank == 0 and len(marks) >= 2 + ACTIVE:
            summary = step_summary(averages, wall_seconds=marks[-1] - marks[-1 - ACTIVE], steps=ACTIVE)
            Path(folder, SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")

    def step() -> None:
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        prof.step()

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=ACTIVE, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write) as prof:
        yield step
