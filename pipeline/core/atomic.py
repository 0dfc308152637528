"""Write outputs under a temporary name and rename them into place, so a reader never sees half of one; read JSON."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final` (file or folder); rename it over `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        _remove(final)
        os.replace(tmp, final)
    finally:
        _remove(tmp)


def read_json(path: Path | str) -> object:
    """The JSON value stored in `path` (UTF-8)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_json(path: Path, data: object) -> None:
    """Write sorted, indented JSON atomically (deterministic bytes for DVC hashes)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
