"""A dataset folder in `datasets`' save_to_disk layout (a folder per split: Arrow stream shards, state.json,
dataset_info.json; dataset_dict.json): the seeded train/validation split, token rows as Arrow tables, each split
written a batch of rows at a time and read back memory-mapped (`SplitRows`). The rows are taken from disk as they are
written, so memory holds one batch, never a split. Shards and batches are cut as save_to_disk cuts them (500 MB
shards, batches of 1,000 rows), so `load_from_disk` and `SplitRows` read it as they read save_to_disk's."""

from __future__ import annotations

import hashlib
import json
import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
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


def split_indices(n: int, validation_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/validation split of n rows; each side keeps the original order."""
    n_val = 0 if validation_fraction == 0 else max(1, round(n * validation_fraction))
    if n - n_val < 1:
        raise ValueError(
            f"data.validation_fraction: {n} row(s) leave nothing to train on; add data or lower data.block_size"
        )
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def to_table(inputs, labels) -> pa.Table:
    """Arrow table with int32 input_ids/labels: fixed-size lists for blocks, variable lists for SFT."""
    if isinstance(inputs, np.ndarray):
        width = inputs.shape[1]
        ids = pa.FixedSizeListArray.from_arrays(pa.array(inputs.ravel(), pa.int32()), width)
        same = labels is inputs  # packed text without a padded tail: one array serves both columns
        columns = {
            "input_ids": ids,
            "labels": ids if same else pa.FixedSizeListArray.from_arrays(pa.array(labels.ravel(), pa.int32()), width),
        }
    else:
        rows = pa.list_(pa.int32())
        columns = {"input_ids": pa.array(inputs, rows), "labels": pa.array(labels, rows)}
    return pa.table(columns)


class SplitRows:
    """One split of a dataset `streamed.write` (or save_to_disk) wrote, read with pyarrow alone (memory-mapped):
    `rows[i]` is row i as {column: numpy array} (input_ids, labels; a preference pair also rejected_input_ids,
    rejected_labels), as datasets' load_from_disk(...).with_format("numpy") gives it. The train ranks read their data
    this way: importing datasets would cost each of them memory and time for columns they only index."""

    def __init__(self, folder: Path):
        table = pa.concat_tables(_mapped_stream(path) for path in split_files(folder))
        self.columns = {name: table.column(name) for name in table.column_names}
        self.rows = table.num_rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: np.array(column[int(index)].values, dtype=np.int64) for name, column in self.columns.items()}


def split_files(folder: Path) -> list[Path]:
    """The Arrow stream files of one split `streamed.write` (or save_to_disk) wrote, in order."""
    files = json.loads((folder / "state.json").read_text(encoding="utf-8"))["_data_files"]
    return [folder / f["filename"] for f in files]


def _mapped_stream(path: Path) -> pa.Table:
    """The Arrow stream file at `path` as a table over a read-only memory map. Reading it touches every record
    batch's header, and the kernel maps the pages around each (64 KB a batch: gigabytes for a large dataset, counted
    in the rank's resident memory); they are released once read, so only the rows trained on are mapped."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    table = pa.ipc.open_stream(pa.py_buffer(mapped)).read_all()
    mapped.madvise(mmap.MADV_DONTNEED)  # the file's pages stay cached; reading a row maps its own again
    return table
