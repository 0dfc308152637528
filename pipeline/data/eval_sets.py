"""Evaluation sets as the eval_set stages write them and evaluate reads them: a folder holding the set's items in our
form, one JSON value a line (`items.jsonl`; text documents as {"text": ...}), and what they are (`set.json`: format,
source, items, whether held out from training). Whatever container a set came in (a folder, a glob, Parquet, a
compressed file, a JSON array), evaluate reads one file of rows in the format it was read as.

A set named by the training data's own path is its held-out part (the last data.heldout_fraction of its items, never
trained on) and is read as the training data is; any other set as its first row shows (`inputs.detected_format`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.atomic import read_json, write_json
from pipeline.data.inputs import detected_format

ITEMS, META = "items.jsonl", "set.json"


@dataclass(frozen=True)
class EvalSet:
    """A written set: its items file and the format they are read as."""

    path: Path
    data_format: str


def set_format(path: str, *, data_format: str, data_paths: tuple[str, ...]) -> str:
    """The format a set is read as: the training data's (`data_format`) for its own files, else its first row's."""
    return data_format if path in data_paths else detected_format(path)


def write_set(folder: Path, found: Iterable, *, data_format: str, source: str, held_out: bool) -> int:
    """Write the items `found` (of `data_format`) as a set into `folder` (new); how many there were."""
    folder.mkdir(parents=True)
    count = 0
    with (folder / ITEMS).open("w", encoding="utf-8") as out:
        for item in found:
            out.write(json.dumps({"text": item} if data_format == "text" else item, ensure_ascii=False) + "\n")
            count += 1
    if not count:
        raise ValueError(f"{source}: no item to evaluate on")
    write_json(folder / META, {"format": data_format, "source": source, "items": count, "held_out": held_out})
    return count


def read_set(folder: Path) -> EvalSet:
    """The set the eval_set stage wrote into `folder`."""
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{folder}: no {META}; expected a set written by the eval_set stage (dvc repro)")
    return EvalSet(folder / ITEMS, read_json(folder / META)["format"])
