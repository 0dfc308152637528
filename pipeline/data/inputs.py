"""The data files users have: a data path names one file, a folder (every data file under it, or the dataset it is:
datasets' save_to_disk layout) or a glob of files; each is plain text (one document per line), JSON (an array of rows,
or one row per line: JSONL), or a table (`tables`: Parquet, CSV, TSV, Arrow), text, JSON, CSV and TSV optionally
compressed (.gz, .bz2, .zst). Read a line, a JSON array's element (or a table's batch of rows) at a time, so that
memory never holds a file; errors name the file and the line (or row, or element). Rows are read as their format
(`formats.canonical`); a row with no text (`formats.is_empty`) is dropped, counted in a `Dropped`. A file's leading
UTF-8 byte order mark (Windows editors, Excel's exports) is not part of its text."""

from __future__ import annotations

import codecs
import glob
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pipeline.data import formats, json_array, tables

CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
KINDS = {  # any other suffix is plain text; a folder data_files names is a saved dataset: "arrow"
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
    ".arrow": "arrow",
}
DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow")
COLUMNS = {  # a table must have
    "text": ("text",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),
}
LINES_BLOCK = 1 << 22  # bytes of a text file decoded at a time (then cut after its last whole line)


def data_files(spec: Path | str) -> list[Path]:
    """The files a data path names, in a fixed (sorted) order: the file itself, every data file under a folder
    (recursively), or the files a glob matches; a folder in datasets' save_to_disk layout is one (a DatasetDict's:
    its `train` split), a folder holding files of that layout otherwise is refused."""
    text = str(spec)
    path = Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        if (saved := tables.saved_dataset(path)) is not None:
            return [saved]
        found = sorted(p for p in path.rglob("*") if p.is_file() and _is_data_file(p))
        if stray := next((p for p in found if p.name in tables.LAYOUT_FILES), None):
            raise ValueError(tables.stray_layout(path, stray))
        if not found:
            raise FileNotFoundError(f"{path}: no data file in this folder (expected {_EXPECTED})")
        return found
    if glob.has_magic(text):
        found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"{text}: no file matches this glob (expected {_EXPECTED})")
        return found
    raise FileNotFoundError(f"{path}: data file not found")


_EXPECTED = (
    "a file, a folder or a glob of .txt, .jsonl, .json, .csv, .tsv (each optionally .gz, .bz2 or .zst), .parquet or "
    f".arrow files, or {tables.SAVED}"
)


def _is_data_file(path: Path) -> bool:
    name = path.name[: -len(path.suffix)] if path.suffix in CODECS else path.name
    return name.endswith(DATA_SUFFIXES)


def kind(path: Path) -> str:
    """How a file is read: "text", "jsonl", "json" or one of `tables.TABLES` (by its suffix, under any compression
    suffix; a saved dataset's folder: "arrow")."""
    if path.is_dir():
        return "arrow"
    suffixes = path.suffixes[:-1] if path.suffix in CODECS else path.suffixes
    return KINDS.get(suffixes[-1] if suffixes else "", "text")


def open_bytes(path: Path) -> io.BufferedReader:
    """The file's bytes, decompressed as they are read where its suffix names a codec, after its leading UTF-8 byte
    order mark if it has one."""
    if path.suffix not in CODECS:
        file = path.open("rb")
    else:
        import pyarrow as pa

        file = io.BufferedReader(pa.input_stream(str(path), compression=CODECS[path.suffix]), 1 << 20)
    if file.peek(len(codecs.BOM_UTF8)).startswith(codecs.BOM_UTF8):
        file.read(len(codecs.BOM_UTF8))
    return file


def stored_files(spec: Path | str) -> list[Path]:
    """The files a data path's content is stored in (a saved dataset's folder: every file under it): what tells
    whether it changed."""
    files = []
    for path in data_files(spec):
        files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return files


def estimated_items(spec: Path | str) -> int:
    """About how many items a data path holds (its lines; a Parquet or Arrow table's rows), counted without decoding:
    a progress bar's total."""
    total = 0
    for path in data_files(spec):
        if kind(path) in tables.TABLES and (rows := tables.count(path, kind(path))) is not None:
            total += rows
            continue
        with open_bytes(path) as file:
            while block := file.read(1 << 22):
                total += block.count(b"\n")
    return total


def lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text or JSONL file, numbered as str.splitlines counts lines; invalid UTF-8 is
    refused with its line. Decoded a block of whole lines at a time."""
    number, newlines, offset, rest = 0, 0, 0, b""
    with open_bytes(path) as file:
        while True:
            block = file.read(LINES_BLOCK)
            data = rest + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            head, rest = data[:cut], data[cut:]
            try:
                text = head.decode("utf-8")
            except UnicodeDecodeError as err:
                line = newlines + head.count(b"\n", 0, err.start) + 1
                raise ValueError(
                    f"{path}:{line}: invalid UTF-8 (byte offset {offset + err.start}); expected UTF-8 text"
                ) from None
            for line in text.splitlines():
                number += 1
                yield number, line
            newlines, offset = newlines + head.count(b"\n"), offset + len(head)
            if not block:
                return


def detected_format(spec: Path | str) -> str:
    """The format a data path's first item shows (`data.format: auto`): text for plain text, else the format of its
    first row (`formats.detect`: refused, with the row, where the fields fit none or several)."""
    path = data_files(spec)[0]
    if kind(path) in tables.TABLES:
        row = next(tables.rows(path, kind(path)), None)
        if row is None:
            raise ValueError(f"{path}: data file is empty")
        return formats.detect(row, formats.where(path, "row 1"))
    if kind(path) != "text":
        if (first := _first_json_row(path)) is None:
            raise ValueError(f"{path}: data file is empty" + (" (an empty JSON array)" if is_array(path) else ""))
        return formats.detect(*first)
    number, line = next(((n, line) for n, line in lines(path) if line.strip()), (0, ""))
    if not number:
        raise ValueError(f"{path}: data file is empty")
    try:  # plain text, unless its lines are JSON rows (read as their format, as JSONL is)
        row = json.loads(line)
    except json.JSONDecodeError:
        return "text"
    if not isinstance(row, dict):
        return "text"
    if (found := formats.detect(row, formats.where(path, number))) == "text":
        raise ValueError(
            f"{path}:{number}: a JSON object with 'text' in a plain text file; expected one document per line, or "
            "its rows in a .jsonl file (their 'text' fields are read then)"
        )
    return found


def _first_json_row(path: Path) -> tuple[dict, str] | None:
    """A JSON file's (an array or JSONL) first row and how errors name it; None for a file without one."""
    if is_array(path):
        elements = json_elements(path)
        return next(((row, formats.where(path, f"element {n} (line {line})")) for n, line, row in elements), None)
    number, line = next(((n, line) for n, line in lines(path) if line.strip()), (0, ""))
    return (_json_row(path, number, line), formats.where(path, number)) if number else None


def resolved_format(data_format: str, spec: Path | str, sources: list[str] | None = None) -> str:
    """`data_format`, or with "auto" the format the data shows: the first row of `spec`, or for a mix the family of
    its `sources`' formats (text, else the first row format among them)."""
    if data_format != "auto":
        return data_format
    if sources:
        return next((f for f in sources if f != "text"), "text")
    return detected_format(spec)


class Line(NamedTuple):
    """A JSONL line not yet parsed (`items(..., deferred=True)`): the cache_dataset workers parse it."""

    path: str
    number: int
    text: str


class Empty(NamedTuple):
    """A row with no text (`formats.is_empty`), named as errors name rows: dropped where it is read."""

    at: str


SHOWN = 5  # dropped rows named in a warning


@dataclass
class Dropped:
    """The rows `items` dropped for holding no text: each one's position among the rows read (kept or not), and the
    first SHOWN named."""

    positions: list[int] = field(default_factory=list)
    places: list[str] = field(default_factory=list)

    def add(self, empty: Empty, position: int) -> None:
        self.positions.append(position)
        if len(self.places) < SHOWN:
            self.places.append(empty.at)

    def rows_for(self, kept: int) -> int:
        """How many rows read hold the first `kept` kept ones: where a deferred stream (every row) is cut to them."""
        rows = kept
        for position in self.positions:
            if position >= rows:
                break
            rows += 1
        return rows

    def refusal(self, key: str, *, rows: int, max_share: float) -> str | None:
        """Why a data path of `rows` rows read (kept and dropped) is refused when more than `max_share` of them hold
        no text: so many empty rows say the file is not what it seems (an export gone wrong), not a few blanks. None
        within the bound."""
        share = len(self.positions) / rows if rows else 0.0
        if share <= max_share:
            return None
        return (
            f"{key}: {len(self.positions)} of {rows} row(s) ({share:.1%}) hold no text (null or empty, or an empty "
            f"conversation), more than data.max_bad_rows={max_share} of them; the first: {self.places[0]}; expected "
            f"rows with text, or -S data.max_bad_rows={math.ceil(share * 100) / 100} to drop them"
        )

    def warning(self, key: str) -> str | None:
        """What the check says of them (None when there are none)."""
        if not self.positions:
            return None
        more = ", ..." if len(self.positions) > len(self.places) else ""
        return (
            f"{key}: {len(self.positions)} row(s) with no text (null or empty, or an empty conversation) dropped: "
            f"{', '.join(self.places)}{more}"
        )


def items(spec: Path | str, data_format: str, *, deferred: bool = False, dropped: Dropped | None = None) -> Iterator:
    """Every item of a data path in order: `text` documents (non-blank lines of a text file, else the "text" field of
    JSON and Parquet rows), or rows of the format (alpaca, chat, prompt_completion, preference) in our form
    (`formats.canonical`; "jsonl": any object, as it is); rows with no text left out, noted in `dropped`. With
    `deferred`, every row read comes, JSONL rows as their `Line` for `parsed` to read where the work is done, and rows
    with no text as their `Empty`."""
    read = 0
    for path in data_files(spec):
        for item in file_items(path, data_format, deferred=deferred):
            if not isinstance(item, Empty) or deferred:
                yield item
            elif dropped is not None:
                dropped.add(item, read)
            read += 1


def parsed(item, data_format: str):
    """The item a deferred `Line` holds (checked as `items` checks it; its `Empty` where it holds no text); any other
    item as it is."""
    if not isinstance(item, Line):
        return item
    return row_item(_json_row(item.path, item.number, item.text), data_format, formats.where(item.path, item.number))


def row_item(row: dict, data_format: str, at: str):
    """A JSON or Parquet row as `data_format` reads it (named `at` in errors), or its `Empty`."""
    if data_format == "jsonl":
        return row
    return Empty(at) if formats.is_empty(row, data_format) else formats.canonical(row, data_format, at)


def file_items(path: Path, data_format: str, *, deferred: bool = False) -> Iterator:
    """The items of one data file, a row with no text as its `Empty` (see `items`)."""
    if kind(path) in tables.TABLES:
        yield from _table_items(path, data_format)
        return
    if kind(path) == "text" and data_format == "text":
        for _, line in lines(path):
            if line.strip():
                yield line.strip()
        return
    if is_array(path):  # a JSON array of rows (Stanford Alpaca's alpaca_data.json, LLaMA-Factory's files)
        for number, line, row in json_elements(path):
            yield row_item(row, data_format, formats.where(path, f"element {number} (line {line})"))
        return
    for number, line in lines(path):  # JSON lines (any suffix but .parquet holds them in the row formats)
        if line.strip():
            row = Line(str(path), number, line)
            yield row if deferred else parsed(row, data_format)


def _json_row(path: Path | str, number: int, line: str) -> dict:
    """Line `number` of a JSONL file as an object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        hint = "; expected one JSON object per line (JSONL) or a JSON array of objects" if number == 1 else ""
        raise ValueError(f"{path}:{number}: invalid JSON ({err.msg}){hint}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    return row


def is_array(path: Path) -> bool:
    """Whether a file's first non-blank character opens a JSON array."""
    with open_bytes(path) as file:
        return json_array.opens_array(file)


def json_elements(path: Path) -> Iterator[tuple[int, int, dict]]:
    """(element number, line, object) of a JSON array file (`json_array.elements`), decompressed as it is read."""
    with open_bytes(path) as file:
        yield from json_array.elements(file, str(path))


def _table_items(path: Path, data_format: str) -> Iterator:
    """The rows of a table file (`tables`) read as `data_format`, named `FILE:row N` in errors."""
    names = tables.columns(path, kind(path))
    missing = [field for field in COLUMNS.get(data_format, ()) if field not in names]
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(repr(m) for m in missing)} (it has {names})")
    only = ["text"] if data_format == "text" else None
    for number, row in enumerate(tables.rows(path, kind(path), only=only), start=1):
        item = row_item(row, data_format, formats.where(path, f"row {number}"))
        if data_format != "text" or isinstance(item, Empty):
            yield item
        elif item.strip():
            yield item.strip()


def unused_columns(spec: Path | str, data_format: str) -> list[str]:
    """The columns of a data path's tables, and the fields of its JSON files' first rows, that `data_format` does not
    read (`formats.unused`), each once."""
    names = [name for path in data_files(spec) for name in _columns(path)]
    return formats.unused(list(dict.fromkeys(names)), data_format)


def _columns(path: Path) -> list[str]:
    """A table's columns; a JSON file's (JSONL or array) first row's fields; none for plain text."""
    if kind(path) in tables.TABLES:
        return tables.columns(path, kind(path))
    if kind(path) == "text":
        return []
    first = _first_json_row(path)
    return list(first[0]) if first else []


def heldout_path(train_file: str, heldout_file: str) -> str | None:
    """Where the held-out part is read from when it is not the training items' tail: `heldout_file` where it names a
    path of its own, a DatasetDict folder's `test` (else `validation`) split where both name that folder; None where
    the last data.heldout_fraction of the training items is held out."""
    if heldout_file != train_file:
        return heldout_file
    split = tables.heldout_split(Path(train_file))
    return None if split is None else str(split)


def response_text(value: object) -> str | None:
    """A preference row's response (`chosen`, `rejected`): a string, or an assistant message's content; None when it
    is neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        return value["content"]
    return None
