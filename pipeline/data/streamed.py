"""The training file (less its held-out tail) tokenized, packed, split and written at any corpus size: the input is
validated a line at a time, tokenized into parts (see `parts`: parallel, resumable), and the rows are then taken from
the parts on disk a batch at a time into the dataset folder (see `saved_splits`). Memory holds a chunk per worker
and a batch of rows, never the corpus; the split indices (8 bytes a row) are the one thing that grows with it.
The rows, the split and the bytes written are those of the in-memory builders (`dataset.build_pretraining`,
`build_instruction`) on the same items, for any chunk size and number of workers."""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.data import parts, saved_splits
from pipeline.data.dataset import IGNORE_INDEX, split_indices, to_table
from pipeline.data.inputs import data_files, items
from pipeline.data.textio import held_out_count, verify
from pipeline.data.tokenizer import load_tokenizer, text_encoder

DENSE = 4  # a batch of rows is read as one range when the range is at most this many times the rows it holds


class Stream:
    """The int32 arrays of consecutive parts read as one, by position (plain reads: nothing mapped)."""

    def __init__(self, files: list[Path]):
        self.files = files
        sizes = [f.stat().st_size // 4 for f in files]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.int32)
        part, at = int(np.searchsorted(self.starts, start, side="right")) - 1, start
        while at < stop:
            low, high = at - self.starts[part], min(stop, self.starts[part + 1]) - self.starts[part]
            out[at - start : at - start + high - low] = np.fromfile(
                self.files[part], dtype=np.int32, count=int(high - low), offset=int(low) * 4
            )
            at += int(high - low)
            part += 1
        return out


def runs(indices: np.ndarray) -> list[np.ndarray]:
    """`indices` (sorted) in groups that are each read as one range: the whole batch when it is dense, else one
    index at a time."""
    if len(indices) and indices[-1] - indices[0] + 1 <= DENSE * len(indices):
        return [indices]
    return [indices[i : i + 1] for i in range(len(indices))]


class Blocks:
    """Rows of `block_size` tokens cut from the stream, the partial last one padded (labels -100) when kept."""

    def __init__(self, stream: Stream, *, block_size: int, tail: str, pad_id: int):
        self.stream, self.size, self.pad_id = stream, block_size, pad_id
        self.full, self.rest = divmod(len(stream), block_size)
        self.count = self.full + (1 if tail == "pad" and self.rest else 0)

    def take(self, indices: np.ndarray) -> pa.Table:
        pieces = []
        for run in runs(indices):
            low, high = int(run[0]), int(run[-1]) + 1
            tokens = self.stream.read(low * self.size, min(high * self.size, len(self.stream)))
            short = (high - low) * self.size - len(tokens)
            if short:
                tokens = np.concatenate([tokens, np.full(short, self.pad_id, dtype=np.int32)])
            pieces.append(tokens.reshape(high - low, self.size)[run - low])
        inputs = np.concatenate(pieces)
        labels = inputs
        if self.count > self.full and indices[-1] == self.full:  # the padded tail block is in this batch
            labels = inputs.copy()
            labels[-1, self.rest :] = IGNORE_INDEX
        return to_table(inputs, labels)


class Examples:
    """SFT examples (variable length) read from the parts' ids and labels."""

    def __init__(self, folder: Path, indices: list[int]):
        self.ids = Stream([parts.array_path(folder, i, "ids") for i in indices])
        self.labels = Stream([parts.array_path(folder, i, "labels") for i in indices])
        lengths = Stream([parts.array_path(folder, i, "lengths") for i in indices])
        self.offsets = np.concatenate([[0], np.cumsum(lengths.read(0, len(lengths)), dtype=np.int64)])
        self.count = len(self.offsets) - 1

    def take(self, indices: np.ndarray) -> pa.Table:
        ids, labels, ends = [], [], [0]
        for run in runs(indices):
            base = int(self.offsets[run[0]])
            span = (base, int(self.offsets[run[-1] + 1]))
            all_ids, all_labels = self.ids.read(*span), self.labels.read(*span)
            for i in run:
                low, high = int(self.offsets[i]) - base, int(self.offsets[i + 1]) - base
                ids.append(all_ids[low:high])
                labels.append(all_labels[low:high])
                ends.append(ends[-1] + high - low)
        offsets = pa.array(ends, pa.int32())
        return pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids), pa.int32())),
                "labels": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(labels), pa.int32())),
            }
        )


def write(out: Path, rows: Blocks | Examples, *, validation_fraction: float, seed: int, tokens: int) -> dict:
    """Split the rows (seeded, as `split_indices`) and write both splits into `out`; the split's figures."""
    train, val = split_indices(rows.count, validation_fraction, seed)
    figures, masked = {"train_rows": int(len(train)), "validation_rows": int(len(val))}, [0, 0]
    out.mkdir(parents=True)
    for name, indices in (("train", train), ("validation", val)):
        first = rows.take(indices[:1]) if len(indices) else rows.take(np.arange(1))
        nbytes = _nbytes(rows, indices, tokens)

        def take(start: int, stop: int, indices=indices, name=name) -> pa.Table:
            table = rows.take(indices[start:stop])
            if name == "train":
                labels = table.column("labels").combine_chunks().flatten().to_numpy()
                masked[0] += int((labels == IGNORE_INDEX).sum())
                masked[1] += len(labels)
            return table

        saved_splits.write_split(out / name, count=len(indices), nbytes=nbytes, schema=first.schema, take=take)
    saved_splits.write_dict(out, ["train", "validation"])
    figures["masked_fraction"] = masked[0] / masked[1] if masked[1] else 0.0
    return figures


def _nbytes(rows: Blocks | Examples, indices: np.ndarray, tokens: int) -> int:
    """The bytes of the split's two columns (int32 tokens, plus 4-byte offsets for SFT rows)."""
    if isinstance(rows, Blocks):
        return 2 * 4 * len(indices) * rows.size
    ends = rows.offsets[indices + 1] - rows.offsets[indices] if len(indices) else np.zeros(0)
    return 2 * 4 * (int(ends.sum()) + len(indices) + 1)


def build(
    out: Path,
    *,
    tokenizer_dir: Path,
    train_file: str,
    heldout_fraction: float | None,
    packing,
    work: Path,
    workers: int,
    chunk_chars: int,
) -> dict:
    """Write the dataset of `train_file` (less its last `heldout_fraction` when given) into `out`; its figures:
    documents, tokens, blocks, padded and dropped tokens (text) or examples, truncated and dropped examples (SFT),
    rows per split, the train split's masked fraction, and tokens/s (per core)."""
    p = packing
    total = verify(train_file, p.data_format)
    limit = total - held_out_count(total, heldout_fraction) if heldout_fraction is not None else total
    job = parts.Job(str(tokenizer_dir), p.data_format, p.template, p.max_seq_len)
    parts.prepare(work, parts.key(job, inputs=data_files(train_file), limit=limit, chunk_chars=chunk_chars))
    start = time.perf_counter()
    summaries = parts.tokenize(
        work,
        job,
        islice(items(train_file, p.data_format), limit),
        total=limit,
        workers=workers,
        chunk_chars=chunk_chars,
    )
    seconds = time.perf_counter() - start
    indices = [s["index"] for s in summaries]
    tokens = sum(s["tokens"] for s in summaries)
    figures: dict = {"documents": limit, "tokens": tokens}
    if job.family == "text":
        tokenizer = text_encoder(tokenizer_dir) or load_tokenizer(tokenizer_dir)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stream = Stream([parts.array_path(work, i, "ids") for i in indices])
        rows = Blocks(stream, block_size=p.block_size, tail=p.tail, pad_id=pad_id if pad_id is not None else 0)
        if rows.count < 1:
            raise ValueError(f"data.block_size: {tokens} tokens make no block of {p.block_size}; lower it or add text")
        figures |= {
            "blocks": rows.count,
            "tokens_dropped": rows.rest if p.tail == "drop" else 0,
            "tokens_padded": (p.block_size - rows.rest) if rows.count > rows.full else 0,
        }
    else:
        rows = Examples(work, indices)
        for key in ("examples", "truncated_examples", "dropped_examples"):
            figures[key] = sum(s[key] for s in summaries)
        if rows.count < 1:
            raise ValueError(
                f"data.max_seq_len: every example lost its response to truncation at {p.max_seq_len} tokens"
            )
    figures |= write(out, rows, validation_fraction=p.validation_fraction, seed=p.seed, tokens=tokens)
    fresh = sum(s["tokens"] for s in summaries if not s.get("reused"))
    reused = sum(1 for s in summaries if s.get("reused"))
    figures |= {
        "parts": len(summaries),
        "parts_reused": reused,
        "workers": workers,
        "tokenize_seconds": round(seconds, 3),
    }
    figures["tokens_per_second_per_core"] = round(fresh / seconds / workers) if seconds > 0 else 0
    return figures
