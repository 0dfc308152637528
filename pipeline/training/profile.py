"""An opt-in torch profiler over a few training steps, for finding where a GPU step's time goes.

`PIPELINE_PROFILE=DIR` (set by `bench.gpu_train --profile`): each rank profiles steps 3 and 4 of its segment (the
first two warm up) and writes the operators by their own device time to DIR/profile_rank{R}.txt. Unset, it costs
nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

VARIABLE = "PIPELINE_PROFILE"
ROWS = 40


@contextlib.contextmanager
def profiled_steps(*, rank: int) -> Iterator[callable]:
    """Yields the function to call after each step; profiles only where PIPELINE_PROFILE names a folder."""
    folder = os.environ.get(VARIABLE)
    if not folder:
        yield lambda: None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"

    def write(prof) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=70)
        Path(folder, f"profile_rank{rank}.txt").write_text(table)

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write) as prof:
        yield prof.step
