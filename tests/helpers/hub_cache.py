"""A huggingface_hub cache filled as the Hub's client fills it (`models--OWNER--NAME/{blobs,snapshots,refs}`), from
a model folder: what a user's machine holds after `hf download`, written from huggingface_hub's cache layout."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, *, repo_id: str, folder: Path, commit: str, ref: str = "main") -> Path:
    """`folder`'s files as snapshot `commit` of `repo_id` in `cache` (blobs named by their sha256, the snapshot's
    files relative links to them), `refs/REF` pointing at it; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(path for path in folder.rglob("*") if path.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
