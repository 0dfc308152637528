"""A dataset folder in `datasets`' save_to_disk layout (a folder per split: Arrow stream shards, state.json,
dataset_info.json; dataset_dict.json), written a batch of rows at a time: the rows are taken from disk as they are
written, so memory holds one batch, never a split. Shards and batches are cut as save_to_disk cuts them (500 MB
shards, batches of 1,000 rows), so `load_from_disk` and `SplitRows` read it as they read save_to_disk's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

MAX_SHARD_BYTES = 500 * 10**6  # datasets' MAX_SHARD_SIZE
MAX_ROW_GROUP_BYTES = 100 * 10**6  # datasets' MAX_ROW_GROUP_SIZE
MAX_BATCH_ROWS = 1000  # datasets' DEFAULT_MAX_BATCH_SIZE

Take = Callable[[int, int], pa.Table]  # rows [start, stop) of the split


def layout(count: int, nbytes: int) -> tuple[int, int]:
    """(shards, rows per written batch) of a split of `count` rows and `nbytes` bytes, as save_to_disk chooses."""
    shards = min(count, int(nbytes / MAX_SHARD_BYTES) + 1)
    batch = MAX_BATCH_ROWS
    if nbytes > 0:
        batch = min(batch, max(1, count * MAX_ROW_GROUP_BYTES // nbytes))
    return shards, batch


def write_split(folder: Path, *, count: int, nbytes: int, schema: pa.Schema, take: Take) -> str:
    """Write the split's `count` rows (taken a batch at a time) into `folder`; returns its fingerprint, a digest of
    every byte of every column written, in order."""
    from datasets import DatasetInfo, Features
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils.py_utils import asdict

    folder.mkdir(parents=True)
    features = Features.from_arrow_schema(schema)
    shards, batch = layout(count, nbytes)
    digest, files = hashlib.sha256(), []
    for index in range(shards):
        div, mod = divmod(count, shards)
        start = div * index + min(index, mod)
        stop = start + div + (1 if index < mod else 0)
        name = f"data-{index:05d}-of-{shards:05d}.arrow"
        writer = ArrowWriter(features=features, path=str(folder / name), embed_local_files=True)
        try:
            for first in range(start, stop, batch):
                table = take(first, min(first + batch, stop))
                for column in table.columns:
                    for chunk in column.chunks:
                        for buffer in chunk.buffers():
                            if buffer is not None:
                                digest.update(buffer)
                writer.write_table(table)
            writer.finalize()
        finally:
            writer.close()
        files.append({"filename": name})
    fingerprint = digest.hexdigest()[:16]
    state = {
        "_data_files": files,
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    _dump(folder / "state.json", state, sort_keys=True)
    info = asdict(DatasetInfo(features=features))
    _dump(folder / "dataset_info.json", {key: info[key] for key in sorted(info)}, sort_keys=False)
    return fingerprint


def write_dict(folder: Path, splits: list[str]) -> None:
    """dataset_dict.json, naming the splits written under `folder`."""
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": splits}), encoding="utf-8")


def _dump(path: Path, value: dict, *, sort_keys: bool) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=sort_keys), encoding="utf-8")
