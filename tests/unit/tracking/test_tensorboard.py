"""TensorBoard as well as MLflow: the curve writer keeps numbers only and reads back (the 2-rank training run's
events are checked by tests/integration/test_tensorboard.py)."""

from __future__ import annotations

from pipeline.tracking.tensorboard import CurveWriter
from tests.helpers.tensorboard_events import read_scalars


def test_writer_keeps_numbers_only(tmp_path):
    writer = CurveWriter(tmp_path)
    writer.log({"step": 1, "loss": 2.5, "note": "x", "flag": True}, 1)
    writer.log({"step": 2, "loss": 2.0}, 2)
    writer.close()
    assert read_scalars(tmp_path) == {"train/loss": [(1, 2.5), (2, 2.0)]}
