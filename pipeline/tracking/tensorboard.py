"""The training curve as TensorBoard event files (`tensorboard --logdir logs/tensorboard`), beside MLflow: one folder
per run, written by global rank 0 only."""

from __future__ import annotations

import os
import time
from pathlib import Path


def run_dir(logdir: Path, root: Path) -> Path:
    """This run's folder: under `root` (the main workspace, also for an experiment DVC runs in a copy) when `logdir`
    is relative, named after the DVC experiment, else after the start time."""
    name = os.environ.get("DVC_EXP_NAME") or time.strftime("run-%Y%m%d-%H%M%S")
    return (Path(logdir) if Path(logdir).is_absolute() else root / logdir) / name


class CurveWriter:
    """Scalars under `train/NAME` at the optimizer step (numbers only)."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))

    def log(self, metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{name}", float(value), step)

    def close(self) -> None:
        self.writer.close()
