"""PNG renderings of the pipeline's DVC plots (the training curve, bits per byte and task scores per model) for
MLflow."""

from __future__ import annotations

import csv
from pathlib import Path


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def _figure(rows: int, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    figure = Figure(figsize=(7, height), layout="constrained")
    return figure, figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]


def training_curve(curve_csv: Path, out: Path) -> None:
    """Training loss (and validation loss where measured) and learning rate against the optimizer step."""
    rows = _rows(curve_csv)
    figure, (loss_axis, lr_axis) = _figure(2, 5.0)
    loss_axis.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label="train loss")
    validated = [r for r in rows if r.get("val_loss")]
    loss_axis.plot(
        [int(r["step"]) for r in validated], [float(r["val_loss"]) for r in validated], "o-", label="validation loss"
    )
    loss_axis.set_ylabel("loss (nats/token)")
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    lr_axis.plot([int(r["step"]) for r in rows], [float(r["lr"]) for r in rows], color="tab:green")
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_xlabel("optimizer step")
    lr_axis.grid(alpha=0.3)
    figure.savefig(out, dpi=100)


def bits_per_byte(table_csv: Path, out: Path) -> None:
    """Horizontal bars: bits per byte of each model on each evaluation set (lower is better)."""
    rows = _rows(table_csv)
    labels = [f"{r['set']} / {r['model']}" for r in rows]
    values = [float(r["bits_per_byte"]) for r in rows]
    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, (axis,) = _figure(1, 1.0 + 0.35 * len(rows))
    bars = axis.barh(range(len(rows)), values, color=[f"C{models.index(r['model'])}" for r in rows])
    axis.bar_label(bars, fmt="%.4f", padding=3)
    axis.set_yticks(range(len(rows)), labels)
    axis.invert_yaxis()
    axis.set_xlabel("bits per byte (lower is better)")
    axis.set_xlim(0, max(values, default=1.0) * 1.2)
    figure.savefig(out, dpi=100)


def task_scores(table_csv: Path, out: Path) -> None:
    """Horizontal bars with standard-error whiskers: each model's score on each task metric (higher is better)."""
    rows = _rows(table_csv)
    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, (axis,) = _figure(1, 1.0 + 0.35 * len(rows))
    errors = [float(r["stderr"]) if r["stderr"] else 0.0 for r in rows]
    bars = axis.barh(
        range(len(rows)),
        [float(r["value"]) for r in rows],
        xerr=errors,
        color=[f"C{models.index(r['model'])}" for r in rows],
    )
    axis.bar_label(bars, fmt="%.3f", padding=3)
    axis.set_yticks(range(len(rows)), [r["label"] for r in rows])
    axis.invert_yaxis()
    axis.set_xlabel("score (higher is better; whiskers: standard error)")
    axis.set_xlim(0, 1.25)
    figure.savefig(out, dpi=100)
