"""What the check stage has read and found valid, remembered by each file's identity (resolved path, size,
modification time, format), so that an unchanged input of many GB is not read again on every run of the pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.core.atomic import atomic_path


def identity(path: str, data_format: str) -> str | None:
    """What identifies `path`'s content for the check, read as `data_format`; None where it is no file (the check
    then reads it, and says what is wrong)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{data_format}"


def load(memo: Path) -> set[str]:
    """The identities verified before (none when the memo is missing or unreadable: everything is read again)."""
    try:
        return set(json.loads(memo.read_text(encoding="utf-8"))["verified"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def save(memo: Path, verified: set[str]) -> None:
    memo.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(memo) as tmp:
        tmp.write_text(json.dumps({"verified": sorted(verified)}, indent=1) + "\n", encoding="utf-8")
