"""Strict readers for user-supplied data paths (a file, a folder or a glob; see `inputs`): errors name the file and
the line. `verify`, `texts`, `held_out_count` and `split_count` stream; the `read_*` functions return lists, for the
small files (evaluation sets) the callers hold whole anyway."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.data.inputs import Dropped, data_files, file_items, items, kind

NAMES = ("role", "from")  # fields that name a message's speaker: not text


def texts(spec: Path | str) -> Iterator[str]:
    """Plain texts of a data path: documents of text files, every string in JSON or Parquet rows (messages included,
    their speakers' names not)."""
    for path in data_files(spec):
        if kind(path) == "text":
            yield from file_items(path, "text")
            continue
        yield from item_texts(file_items(path, "jsonl"))


def item_texts(found: Iterable) -> Iterator[str]:
    """The non-empty strings of documents and rows (nested ones included, speakers' names not)."""
    for item in found:
        yield from _strings(item)


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        if value:
            yield value
    elif isinstance(value, dict):
        for key, inner in value.items():
            if key not in NAMES:
                yield from _strings(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _strings(inner)


def stream(spec: Path | str, data_format: str, *, dropped: Dropped | None = None) -> Iterator:
    """The items of a data path as its format reads (`texts` for "texts", else `inputs.items`, rows with no text
    noted in `dropped`)."""
    return texts(spec) if data_format == "texts" else items(spec, data_format, dropped=dropped)


def verify(spec: Path | str, data_format: str, *, dropped: Dropped | None = None) -> int:
    """`read_data`'s checks, with its errors, an item at a time (memory of one line, not of the file); how many
    documents or rows the path holds, rows with no text left out (noted in `dropped`); refused when none is left."""
    count = sum(1 for _ in stream(spec, data_format, dropped=dropped))
    if count == 0 and dropped is not None and dropped.positions:  # "empty" would hide the rows the file does hold
        raise ValueError(
            f"{spec}: none of its {len(dropped.positions)} row(s) holds text (null or empty, or an empty "
            f"conversation; the first: {dropped.places[0]}); expected rows with text"
        )
    if count == 0:
        raise ValueError(f"{spec}: data file is empty")
    return count


def read_data(spec: Path | str, data_format: str) -> list:
    """A data path as its format reads: `text` documents (one per line), rows with the format's fields, or texts."""
    found = list(stream(spec, data_format))
    if not found:
        raise ValueError(f"{spec}: data file is empty")
    return found


def read_documents(spec: Path | str) -> list[str]:
    """One document per non-blank line (or text field)."""
    return read_data(spec, "text")


def read_texts(spec: Path | str) -> list[str]:
    """Plain texts of a data path (see `texts`)."""
    return read_data(spec, "texts")


def held_out_count(count: int, fraction: float) -> int:
    """How many of a file's `count` items are held out: the last `fraction` of them, at least one, never all."""
    held = max(1, round(count * fraction))
    if held >= count:
        raise ValueError(f"data.heldout_fraction: {fraction} of {count} item(s) leaves nothing to train on")
    return held


def split_count(spec: Path | str, data_format: str, fraction: float) -> int:
    """How many leading items of a data path are trained on when its last `fraction` is held out (counted a line at a
    time, with `verify`'s checks): the training part is `islice(items, n)`, the held-out part `islice(items, n,
    None)`, how one file serves as both when no held-out file is given."""
    count = verify(spec, data_format)
    return count - held_out_count(count, fraction)
