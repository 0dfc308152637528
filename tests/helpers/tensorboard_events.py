"""TensorBoard's event files read back, as TensorBoard reads them (what the tests check the curve against)."""

from __future__ import annotations

from pathlib import Path


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the event files in `folder`, every point kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
