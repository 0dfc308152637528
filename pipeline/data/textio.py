"""Strict readers for user-supplied data paths (a file, a folder or a glob; see `inputs`): errors name the file and
the line. `verify` and `held_out_count` stream; the `read_*` functions return lists, for the small files
(evaluation and tokenizer sets) the stages that call them hold whole anyway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipeline.data.inputs import data_files, file_items, items, kind


def texts(spec: Path | str) -> Iterator[str]:
    """Plain texts of a data path: documents of text files, every string field (and message) of JSONL or Parquet
    rows."""
    for path in data_files(spec):
        if kind(path) == "text":
            yield from file_items(path, "text")
            continue
        for row in file_items(path, "jsonl") if kind(path) == "jsonl" else _parquet_rows(path):
            messages = row.get("messages") or []
            yield from (m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
            yield from (v for v in row.values() if isinstance(v, str) and v)


def _parquet_rows(path: Path) -> Iterator[dict]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches():
        yield from batch.to_pylist()


def stream(spec: Path | str, data_format: str) -> Iterator:
    """The items of a data path as its format reads (`texts` for "texts", else `inputs.items`)."""
    return texts(spec) if data_format == "texts" else items(spec, data_format)


def verify(spec: Path | str, data_format: str) -> int:
    """`read_data`'s checks, with its errors, an item at a time (memory of one line, not of the file); how many
    documents or rows the path holds."""
    count = sum(1 for _ in stream(spec, data_format))
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


def held_out(items: list, fraction: float) -> tuple[list, list]:
    """(training part, held-out part) of a file's documents or rows: the last `fraction` of them is held out; how
    one file serves as both when no held-out file is given."""
    held = held_out_count(len(items), fraction)
    return items[:-held], items[-held:]
