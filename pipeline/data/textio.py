"""Strict readers for user-supplied text and JSONL files: errors name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path


def read_text(path: Path | str) -> str:
    """Read a non-empty UTF-8 text file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: invalid UTF-8 (byte offset {err.start}); expected UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{path}: data file is empty")
    return text


def read_documents(path: Path | str) -> list[str]:
    """One document per non-blank line."""
    return [line for line in (raw.strip() for raw in read_text(path).splitlines()) if line]


def read_jsonl(path: Path | str, required: tuple[str, ...]) -> list[dict]:
    """Parse JSONL objects, each holding every `required` field."""
    rows = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if line.strip():
            rows.append(_check_row(path, number, line, required))
    return rows


def _check_row(path: Path | str, number: int, line: str, required: tuple[str, ...]) -> dict:
    """Line `number` of a JSONL file as an object holding every `required` field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    missing = [field for field in required if field not in row]
    if missing:
        raise ValueError(f"{path}:{number}: missing field(s) {', '.join(repr(m) for m in missing)}")
    if "messages" in required and not _valid_messages(row["messages"]):
        raise ValueError(
            f'{path}:{number}: \'messages\' must be a non-empty list of {{"role": str, "content": str}} objects'
        )
    return row


def verify(path: Path | str, data_format: str) -> int:
    """`read_data`'s checks, with its errors, a line at a time (memory of one line, not of the file); how many
    documents or rows the file holds."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    required = REQUIRED_FIELDS.get(data_format, ())
    count, number, offset = 0, 0, 0
    with path.open("rb") as file:
        for newline, raw in enumerate(file):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{newline + 1}: invalid UTF-8 (byte offset {offset + err.start}); expected UTF-8 text"
                ) from None
            offset += len(raw)
            for line in text.splitlines():  # str.splitlines' line breaks, as the readers number lines
                number += 1
                if not line.strip():
                    continue
                count += 1
                if data_format != "text":
                    _check_row(path, number, line, required)
    if count == 0:
        raise ValueError(f"{path}: data file is empty")
    return count


def _valid_messages(messages: object) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def read_texts(path: Path | str) -> list[str]:
    """Plain texts of a data file: lines of a .txt, or every string field of a .jsonl's rows."""
    if Path(path).suffix != ".jsonl":
        return read_documents(path)
    texts = []
    for row in read_jsonl(path, ()):
        messages = row.get("messages", [])
        texts += [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
        texts += [v for v in row.values() if isinstance(v, str) and v]
    return texts


REQUIRED_FIELDS = {"alpaca": ("instruction", "output"), "chat": ("messages",)}  # of each JSONL data format


def held_out(items: list, fraction: float) -> tuple[list, list]:
    """(training part, held-out part) of a file's documents or rows: the last `fraction` of them (at least one) is
    held out; how one file serves as both when no held-out file is given."""
    count = max(1, round(len(items) * fraction))
    if count >= len(items):
        raise ValueError(f"data.heldout_fraction: {fraction} of {len(items)} item(s) leaves nothing to train on")
    return items[:-count], items[-count:]


def read_data(path: Path | str, data_format: str) -> list:
    """A data file as its format reads: `text` documents (one per line), else JSONL rows with the format's fields."""
    if data_format == "text":
        return read_documents(path)
    return read_jsonl(path, REQUIRED_FIELDS.get(data_format, ()))
