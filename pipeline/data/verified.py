"""What the check stage has read and found valid, remembered by each file's identity (resolved path, size,
modification time, format), so that an unchanged input of many GB is not read again on every run of the pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.data.inputs import stored_files


def identity(path: str, data_format: str) -> str | None:
    """What identifies the content of data path `path` (a file, folder or glob: every file it names) for the check,
    read as `data_format`; None where it names no file or a folder it refuses (the check then reads it, and says what
    is wrong)."""
    try:
        files = [(f.resolve(), os.stat(f)) for f in stored_files(path)]
    except (OSError, ValueError):
        return None
    named = ";".join(f"{file}|{stat.st_size}|{stat.st_mtime_ns}" for file, stat in files)
    return f"{path}={named}|{data_format}"


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
