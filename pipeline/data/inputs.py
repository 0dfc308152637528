"""The data files users have: a data path names one file, a folder (every data file under it) or a glob of files;
each is plain text (one document per line), JSONL or Parquet, each optionally compressed (.gz, .bz2, .zst). Read a
line (or a Parquet batch) at a time, so that memory never holds a file; errors name the file and the line (or row)."""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
KINDS = {".jsonl": "jsonl", ".parquet": "parquet"}  # any other suffix is plain text
DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".parquet")
REQUIRED_FIELDS = {
    "text": (),
    "alpaca": ("instruction", "output"),
    "chat": ("messages",),
    "preference": ("chosen", "rejected"),  # and one of "prompt", "messages" (`check_fields`)
    "jsonl": (),
}
PARQUET_ROWS = 4096  # rows of a Parquet file decoded at a time
LINES_BLOCK = 1 << 22  # bytes of a text file decoded at a time (then cut after its last whole line)


def data_files(spec: Path | str) -> list[Path]:
    """The files a data path names, in a fixed (sorted) order: the file itself, every data file under a folder
    (recursively), or the files a glob matches."""
    text = str(spec)
    path = Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and _is_data_file(p))
        if not found:
            raise FileNotFoundError(f"{path}: no data file in this folder (expected {_EXPECTED})")
        return found
    if glob.has_magic(text):
        found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"{text}: no file matches this glob (expected {_EXPECTED})")
        return found
    raise FileNotFoundError(f"{path}: data file not found")


_EXPECTED = "a file, a folder or a glob of .txt, .jsonl or .parquet files, each optionally .gz, .bz2 or .zst"


def _is_data_file(path: Path) -> bool:
    name = path.name[: -len(path.suffix)] if path.suffix in CODECS else path.name
    return name.endswith(DATA_SUFFIXES)


def kind(path: Path) -> str:
    """How a file is read: "text", "jsonl" or "parquet" (by its suffix, under any compression suffix)."""
    suffixes = path.suffixes[:-1] if path.suffix in CODECS else path.suffixes
    return KINDS.get(suffixes[-1] if suffixes else "", "text")


def open_bytes(path: Path) -> io.BufferedReader:
    """The file's bytes, decompressed as they are read where its suffix names a codec."""
    if path.suffix not in CODECS:
        return path.open("rb")
    import pyarrow as pa

    return io.BufferedReader(pa.input_stream(str(path), compression=CODECS[path.suffix]), 1 << 20)


def estimated_items(spec: Path | str) -> int:
    """About how many items a data path holds (its lines; a Parquet file's rows), counted without decoding: a
    progress bar's total."""
    total = 0
    for path in data_files(spec):
        if kind(path) == "parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
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


class Line(NamedTuple):
    """A JSONL line not yet parsed (`items(..., deferred=True)`): the cache_dataset workers parse it."""

    path: str
    number: int
    text: str


def items(spec: Path | str, data_format: str, *, deferred: bool = False) -> Iterator:
    """Every item of a data path in order: `text` documents (non-blank lines of a text file, else the "text" field of
    JSONL rows and Parquet rows), or rows holding the format's fields (alpaca, chat, preference; "jsonl": any
    object). With `deferred`, JSONL rows come as their `Line`, for `parsed` to read where the work is done."""
    for path in data_files(spec):
        yield from file_items(path, data_format, deferred=deferred)


def parsed(item, data_format: str):
    """The item a deferred `Line` holds (checked as `items` checks it); any other item as it is."""
    if not isinstance(item, Line):
        return item
    required = () if data_format == "text" else REQUIRED_FIELDS[data_format]
    row = check_row(item.path, item.number, item.text, required)
    return _document(item.path, item.number, row) if data_format == "text" else row


def file_items(path: Path, data_format: str, *, deferred: bool = False) -> Iterator:
    """The items of one data file (see `items`)."""
    required = ("text",) if data_format == "text" else REQUIRED_FIELDS[data_format]
    if kind(path) == "parquet":
        yield from _parquet_items(path, data_format, required)
        return
    if kind(path) == "text" and data_format == "text":
        for _, line in lines(path):
            if line.strip():
                yield line.strip()
        return
    for number, line in lines(path):  # JSONL (any suffix but .parquet holds JSONL rows in the row formats)
        if line.strip():
            row = Line(str(path), number, line)
            yield row if deferred else parsed(row, data_format)


def _document(path: Path | str, where: int | str, row: dict) -> str:
    if "text" not in row:
        raise ValueError(
            f"{path}:{where}: a JSON object in a text source without a 'text' field; expected plain text (one "
            "document per line) or rows with 'text', or the data format alpaca/chat/preference"
        )
    text = row["text"]
    if not isinstance(text, str):
        raise ValueError(f"{path}:{where}: 'text' must be a string, got {type(text).__name__}")
    return text


def _parquet_items(path: Path, data_format: str, required: tuple[str, ...]) -> Iterator:
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(path)
    missing = [field for field in required if field not in reader.schema_arrow.names]
    if missing:
        raise ValueError(
            f"{path}: no column(s) {', '.join(repr(m) for m in missing)} (it has {reader.schema_arrow.names})"
        )
    number = 0
    for batch in reader.iter_batches(batch_size=PARQUET_ROWS, columns=["text"] if data_format == "text" else None):
        for row in batch.to_pylist():
            number += 1
            if data_format == "text":
                if (text := _document(path, f"row {number}", row)).strip():
                    yield text.strip()
            else:
                yield check_fields(path, f"row {number}", row, required)


def check_row(path: Path | str, number: int, line: str, required: tuple[str, ...]) -> dict:
    """Line `number` of a JSONL file as an object holding every `required` field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    return check_fields(path, number, row, required)


def check_fields(path: Path | str, where: int | str, row: dict, required: tuple[str, ...]) -> dict:
    """`row` (at line or row `where`), refused when a `required` field is missing, its messages are malformed, or
    (a preference pair) it lacks its prompt or a response is not text."""
    missing = [field for field in required if row.get(field) is None]
    if missing:
        raise ValueError(f"{path}:{where}: missing field(s) {', '.join(repr(m) for m in missing)}")
    if "messages" in required:
        _check_messages(path, where, row["messages"])
    if "rejected" in required:
        _check_pair(path, where, row)
    return row


def response_text(value: object) -> str | None:
    """A preference row's response (`chosen`, `rejected`): a string, or an assistant message's content; None when it
    is neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _check_pair(path: Path | str, where: int | str, row: dict) -> None:
    """Refuse a preference row without exactly one of a prompt string and a conversation, or with a response that is
    neither a string nor an assistant message."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        found = "neither 'prompt' nor 'messages'" if prompt is None else "both 'prompt' and 'messages'"
        raise ValueError(
            f"{path}:{where}: {found}; expected one of them: 'prompt' (a string) or 'messages' (the conversation "
            "before the responses)"
        )
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{path}:{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if messages is not None:
        _check_messages(path, where, messages)
    for field in ("chosen", "rejected"):
        if response_text(row[field]) is None:
            raise ValueError(
                f'{path}:{where}: {field!r} must be a string or {{"role": "assistant", "content": str}}, '
                f"got {row[field]!r:.80}"
            )


def _check_messages(path: Path | str, where: int | str, messages: object) -> None:
    if not _valid_messages(messages):
        raise ValueError(
            f'{path}:{where}: \'messages\' must be a non-empty list of {{"role": str, "content": str}} objects'
        )


def _valid_messages(messages: object) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
