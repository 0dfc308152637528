"""TensorBoard as well as MLflow: the 2-rank training run of the session (tests/conftest.py) wrote its curve as
TensorBoard events, once (rank 0), with the values of the curve CSV."""

from __future__ import annotations

import csv

import pytest

from tests.helpers.tensorboard_events import read_scalars


@pytest.mark.integration
def test_training_curve_read_back_from_tensorboard_events(two_ranks_zero2):
    runs = list((two_ranks_zero2 / "tensorboard").iterdir())
    assert len(runs) == 1 and len(list(runs[0].glob("events.out.tfevents.*"))) == 1, "rank 0 alone writes"
    scalars = read_scalars(runs[0])
    with open(two_ranks_zero2 / "curve.csv", encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [step for step, _ in scalars["train/loss"]] == [int(r["step"]) for r in rows] == list(range(1, 7))
    for (_, value), row in zip(scalars["train/loss"], rows, strict=True):
        assert value == pytest.approx(float(row["loss"]), rel=1e-5)
    assert [step for step, _ in scalars["train/val_loss"]] == [3, 6]
    assert {"train/lr", "train/tokens_per_s", "train/val_perplexity"} <= scalars.keys()
