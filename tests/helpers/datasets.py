"""The in-memory dataset builders: every document or row tokenized, packed and split in memory, as the streamed
cache (`pipeline.data.streamed`, which holds a chunk at a time) must write them byte for byte. They are the oracle the
tests compare the cache with, and build the tests' small datasets."""

from __future__ import annotations

import hashlib
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.data.encoding import encode, tokenize_documents
from pipeline.data.examples import IGNORE_INDEX, sft_arrays
from pipeline.data.mixing import Source, check_source, choose, planned_shares, report
from pipeline.data.saved_splits import split_indices, to_table
from pipeline.data.textio import read_data
from pipeline.data.whole_documents import document_rows


def pack_blocks(stream: np.ndarray, *, block_size: int, tail: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the token stream into [n, block_size] inputs and labels; the tail is dropped or padded (label -100).
    Without a padded tail the labels are the inputs themselves (one array, a view of the stream)."""
    full = len(stream) // block_size
    rest = len(stream) - full * block_size
    inputs = stream[: full * block_size].reshape(full, block_size)
    labels = inputs
    if tail == "pad" and rest:
        last = np.full(block_size, pad_id, dtype=np.int32)
        last[:rest] = stream[-rest:]
        last_labels = np.full(block_size, IGNORE_INDEX, dtype=np.int32)
        last_labels[:rest] = stream[-rest:]
        inputs, labels = np.vstack([inputs, last]), np.vstack([labels, last_labels])
    return inputs, labels


def build_sft(tokenizer, rows: list[dict], *, template: str, max_seq_len: int) -> tuple[list, list, dict]:
    """`sft_arrays` as lists: each kept example's token ids and labels, and the counts."""
    arrays, counts = sft_arrays(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    if not len(arrays["lengths"]):
        return [], [], counts
    bounds = np.cumsum(arrays["lengths"])[:-1]
    inputs, labels = (np.split(arrays[name], bounds) for name in ("ids", "labels"))
    return [a.tolist() for a in inputs], [a.tolist() for a in labels], counts


def save_splits(out_dir: Path, tables: dict[str, pa.Table]) -> None:
    """save_to_disk with content-derived fingerprints, so identical inputs give identical bytes."""
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    splits = {}
    for name, table in tables.items():
        digest = hashlib.sha256()
        for column in table.columns:
            for chunk in column.chunks:
                for buffer in chunk.buffers():
                    if buffer is not None:
                        digest.update(buffer)
        splits[name] = Dataset(InMemoryTable(table), fingerprint=digest.hexdigest()[:16])
    DatasetDict(splits).save_to_disk(str(out_dir))


def masked_fraction(labels) -> float:
    """Share of label positions set to -100 (prompt or padding)."""
    flat = labels.ravel() if isinstance(labels, np.ndarray) else np.fromiter(chain.from_iterable(labels), np.int32)
    return float((flat == IGNORE_INDEX).mean()) if flat.size else 0.0


def source_tokens(sources: np.ndarray, n_sources: int) -> list[int]:
    """Tokens per source among `sources` (a source index per token; -1 marks padding)."""
    return np.bincount(sources[sources >= 0], minlength=n_sources).tolist()


def build_pretraining(
    tokenizer,
    documents: list[str],
    *,
    block_size: int,
    tail: str,
    validation_fraction: float,
    seed: int,
    token_sources: tuple[np.ndarray, int] | None = None,
    packing: str = "blocks",
) -> tuple[dict[str, pa.Table], dict]:
    """Pack documents into train/validation block tables (`packing` documents: a row per document, `document_rows`);
    returns them and their statistics. With `token_sources` (the source index of every token of the stream, and
    the number of sources), the statistics also count the train split's tokens per source (`source_tokens`)."""
    stream, lengths = tokenize_documents(tokenizer, documents)
    n_docs = len(lengths)
    if packing == "documents":
        starts, sizes, figures = document_rows(lengths, block_size)
        rows = [stream[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        train, val = split_indices(len(rows), validation_fraction, seed)
        stats = {"documents": n_docs, "tokens": int(len(stream)), **figures, "train_rows": int(len(train)),
                 "validation_rows": int(len(val)), "masked_fraction": 0.0}  # fmt: skip
        tables = {
            name: to_table(_take(rows, part), _take(rows, part))
            for name, part in (("train", train), ("validation", val))
        }
        return tables, stats
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs, labels = pack_blocks(stream, block_size=block_size, tail=tail, pad_id=pad_id if pad_id is not None else 0)
    if len(inputs) < 1:
        raise ValueError(f"data.block_size: {len(stream)} tokens make no block of {block_size}; lower it or add text")
    train, val = split_indices(len(inputs), validation_fraction, seed)
    stats = {
        "documents": n_docs,
        "tokens": int(len(stream)),
        "tokens_dropped": int(len(stream) % block_size) if tail == "drop" else 0,
        "train_rows": int(len(train)),
        "validation_rows": int(len(val)),
        "masked_fraction": 0.0 if labels is inputs else masked_fraction(labels[train]),
    }
    if token_sources is not None:
        per_token, n_sources = token_sources
        if len(per_token) != len(stream):
            raise AssertionError(f"{len(per_token)} token sources for a stream of {len(stream)} tokens")
        blocks, _ = pack_blocks(per_token.astype(np.int32), block_size=block_size, tail=tail, pad_id=-1)
        stats["source_tokens"] = source_tokens(blocks[train], n_sources)
    return {"train": _rows(inputs, labels, train), "validation": _rows(inputs, labels, val)}, stats


def _rows(inputs: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> pa.Table:
    """The table of the blocks at `indices`, copied once where the labels are the inputs."""
    rows = inputs[indices]
    return to_table(rows, rows if labels is inputs else labels[indices])


def _take(rows: list, indices: np.ndarray) -> list:
    return [rows[i] for i in indices]


def build_instruction(
    tokenizer, rows: list[dict], *, template: str, max_seq_len: int, validation_fraction: float, seed: int
) -> tuple[dict[str, pa.Table], dict]:
    """Tokenize SFT rows into train/validation tables (prompt tokens masked); returns them and statistics."""
    inputs, labels, stats = build_sft(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    if not inputs:
        raise ValueError(f"data.max_seq_len: every example lost its response to truncation at {max_seq_len} tokens")
    stats["documents"] = len(rows)
    return split_instruction(inputs, labels, stats, validation_fraction=validation_fraction, seed=seed)


def split_instruction(
    inputs: list,
    labels: list,
    stats: dict,
    *,
    validation_fraction: float,
    seed: int,
    example_sources: tuple[list[int], int] | None = None,
) -> tuple[dict[str, pa.Table], dict]:
    """Tokenized SFT examples -> train/validation tables and `stats` completed; with `example_sources` (the source
    index of every example, and the number of sources) also the train split's tokens per source."""
    train, val = split_indices(len(inputs), validation_fraction, seed)
    stats = {
        **stats,
        "tokens": sum(map(len, inputs)),
        "train_rows": int(len(train)),
        "validation_rows": int(len(val)),
        "masked_fraction": masked_fraction(_take(labels, train)),
    }
    if example_sources is not None:
        per_example, n_sources = example_sources
        per_token = np.fromiter(chain.from_iterable([per_example[i]] * len(inputs[i]) for i in train), np.int64)
        stats["source_tokens"] = source_tokens(per_token, n_sources)
    return {
        "train": to_table(_take(inputs, train), _take(labels, train)),
        "validation": to_table(_take(inputs, val), _take(labels, val)),
    }, stats


def read_source(source: Source, key: str) -> list:
    """A source's documents (text) or rows (alpaca, chat), refused with the file and line when the file does not
    hold its format."""
    check_source(source, key)
    return read_data(source.file, source.format)


def mix_text(
    tokenizer,
    sources: list[Source],
    documents: list[list[str]],
    *,
    block_size: int,
    tail: str,
    validation_fraction: float,
    seed: int,
) -> tuple[dict[str, pa.Table], dict]:
    """Pack the mix of text sources into train/validation blocks; statistics with `sources`."""
    eos = 1 if tokenizer.eos_token_id is not None else 0
    lengths = [np.array([len(ids) + eos for ids in encode(tokenizer, d, add_special_tokens=True)]) for d in documents]
    shares = planned_shares(sources)
    mix = choose(lengths, shares, seed)
    per_token = np.repeat(np.array([i for i, _ in mix], dtype=np.int64), [lengths[i][j] for i, j in mix])
    tables, stats = build_pretraining(
        tokenizer,
        [documents[i][j] for i, j in mix],
        block_size=block_size,
        tail=tail,
        seed=seed,
        validation_fraction=validation_fraction,
        token_sources=(per_token, len(sources)),
    )
    items = np.bincount([i for i, _ in mix], minlength=len(sources)).tolist()
    stats["sources"] = report(sources, shares, stats.pop("source_tokens"), items)
    return tables, stats


def mix_instruction(
    tokenizer,
    sources: list[Source],
    rows: list[list[dict]],
    *,
    template: str,
    max_seq_len: int,
    validation_fraction: float,
    seed: int,
) -> tuple[dict[str, pa.Table], dict]:
    """Tokenize each instruction source (prompts masked), mix the examples by tokens and split them into
    train/validation; statistics with `sources`."""
    built = [build_sft(tokenizer, r, template=template, max_seq_len=max_seq_len) for r in rows]
    for source, (inputs, _, _) in zip(sources, built, strict=True):
        if not inputs:
            raise ValueError(
                f"data.max_seq_len: every example of {source.file} lost its response to truncation at {max_seq_len}"
            )
    shares = planned_shares(sources)
    mix = choose([np.array([len(ids) for ids in b[0]]) for b in built], shares, seed)
    stats = {key: sum(b[2][key] for b in built) for key in ("examples", "truncated_examples", "dropped_examples")} | {
        "documents": sum(map(len, rows))
    }
    tables, stats = split_instruction(
        [built[i][0][j] for i, j in mix],
        [built[i][1][j] for i, j in mix],
        stats,
        seed=seed,
        validation_fraction=validation_fraction,
        example_sources=([i for i, _ in mix], len(sources)),
    )
    items = np.bincount([i for i, _ in mix], minlength=len(sources)).tolist()
    stats["sources"] = report(sources, shares, stats.pop("source_tokens"), items)
    return tables, stats
