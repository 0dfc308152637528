"""The training file (less its held-out tail) tokenized, packed, split and written at any corpus size: the input is
validated a line at a time, tokenized into parts (see `parts`: parallel, resumable), and the rows are then taken from
the parts on disk a batch at a time into the dataset folder (see `saved_splits`). Memory holds a chunk per worker
and a batch of rows, never the corpus; the split indices (8 bytes a row) are the one thing that grows with it.
The rows, the split and the bytes written are those of the in-memory builders (`build_pretraining`,
`build_instruction` of tests/helpers/datasets.py) on the same items, for any chunk size and number of workers;
preference pairs (`Pairs`: a row per pair, split over pairs) likewise do not depend on either."""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.data import mixing, parts, saved_splits
from pipeline.data.examples import IGNORE_INDEX, PAIR_COLUMNS, PAIR_COUNTS, SFT_ARRAYS
from pipeline.data.inputs import Dropped, estimated_items, items, stored_files
from pipeline.data.saved_splits import split_indices, to_table
from pipeline.data.textio import held_out_count, verify
from pipeline.data.tokenizer import light_tokenizer, load_tokenizer
from pipeline.data.whole_documents import document_rows

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


class Mixed:
    """Items (documents or examples) of several sources' streams in a mixed order, read as one stream; it also
    counts the tokens of each source in a range."""

    def __init__(self, streams: list[Stream], lengths: list[np.ndarray], mix: np.ndarray):
        self.streams, self.source = streams, mix[:, 0]
        self.length = np.empty(len(mix), dtype=np.int64)
        self.origin = np.empty(len(mix), dtype=np.int64)  # where each item starts in its source's stream
        for i, length in enumerate(lengths):
            chosen = self.source == i
            starts = np.concatenate([[0], np.cumsum(length, dtype=np.int64)])
            self.length[chosen], self.origin[chosen] = length[mix[chosen, 1]], starts[mix[chosen, 1]]
        self.starts = np.concatenate([[0], np.cumsum(self.length)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _spans(self, start: int, stop: int):
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for k in range(max(first, 0), len(self.length)):
            if self.starts[k] >= stop:
                return
            low, high = max(start, int(self.starts[k])), min(stop, int(self.starts[k + 1]))
            yield k, low, high

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.int32)
        for k, low, high in self._spans(start, stop):
            at = int(self.origin[k]) + low - int(self.starts[k])
            out[low - start : high - start] = self.streams[self.source[k]].read(at, at + high - low)
        return out

    def source_tokens(self, start: int, stop: int, counts: np.ndarray) -> None:
        """Add the tokens of [start, stop) to `counts`, by source."""
        for k, low, high in self._spans(start, stop):
            counts[self.source[k]] += high - low


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

    def source_tokens(self, indices: np.ndarray, counts: np.ndarray) -> None:
        for i in indices:
            self.stream.source_tokens(int(i) * self.size, min((int(i) + 1) * self.size, len(self.stream)), counts)


class Examples:
    """SFT examples (variable length) read from streams of ids and labels (`lengths` tokens each, in order; or from
    `starts` on, where rows leave tokens out between them: whole documents, `whole_documents.document_rows`)."""

    def __init__(
        self, ids: Stream | Mixed, labels: Stream | Mixed, lengths: np.ndarray, starts: np.ndarray | None = None
    ):
        self.ids, self.labels = ids, labels
        lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if starts is None else starts.astype(np.int64)
        self.ends = self.starts + lengths
        self.count = len(lengths)

    @classmethod
    def of_parts(cls, folder: Path, indices: list[int]) -> Examples:
        ids, labels, lengths = (Stream([parts.array_path(folder, i, name) for i in indices]) for name in SFT_ARRAYS)
        return cls(ids, labels, lengths.read(0, len(lengths)))

    def pieces(self, indices: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The ids and the labels of the examples at `indices` (sorted, not empty)."""
        ids, labels = [], []
        for run in runs(indices):
            base = int(self.starts[run[0]])
            span = (base, int(self.ends[run[-1]]))
            all_ids, all_labels = self.ids.read(*span), self.labels.read(*span)
            for i in run:
                low, high = int(self.starts[i]) - base, int(self.ends[i]) - base
                ids.append(all_ids[low:high])
                labels.append(all_labels[low:high])
        return ids, labels

    def take(self, indices: np.ndarray) -> pa.Table:
        ids, labels = self.pieces(indices)
        return pa.table({"input_ids": list_column(ids), "labels": list_column(labels)})

    def tokens(self, indices: np.ndarray) -> int:
        """The tokens of the examples at `indices`."""
        return int((self.ends[indices] - self.starts[indices]).sum())

    def source_tokens(self, indices: np.ndarray, counts: np.ndarray) -> None:
        for i in indices:
            self.ids.source_tokens(int(self.starts[i]), int(self.ends[i]), counts)


def list_column(pieces: list[np.ndarray]) -> pa.ListArray:
    """Rows of int32 tokens as one list<int32> column."""
    ends = np.concatenate([[0], np.cumsum([len(piece) for piece in pieces], dtype=np.int64)])
    return pa.ListArray.from_arrays(pa.array(ends, pa.int32()), pa.array(np.concatenate(pieces), pa.int32()))


class Pairs:
    """Preference pairs read from their examples, two a pair (chosen, then rejected): a row holds the chosen side as
    `input_ids`, `labels` and the rejected side as `rejected_input_ids`, `rejected_labels` (`PAIR_COLUMNS`). Rows
    are pairs, so the split never puts the two sides of one pair apart."""

    def __init__(self, examples: Examples):
        self.examples = examples
        self.count = examples.count // 2

    @classmethod
    def of_parts(cls, folder: Path, indices: list[int]) -> Pairs:
        return cls(Examples.of_parts(folder, indices))

    @staticmethod
    def sides(indices: np.ndarray) -> np.ndarray:
        """The examples of the pairs at `indices`: each pair's chosen, then its rejected."""
        return np.stack([2 * indices, 2 * indices + 1], axis=1).ravel()

    def take(self, indices: np.ndarray) -> pa.Table:
        ids, labels = self.examples.pieces(self.sides(indices))
        columns = (ids[0::2], labels[0::2], ids[1::2], labels[1::2])
        return pa.table({name: list_column(rows) for name, rows in zip(PAIR_COLUMNS, columns, strict=True)})


def write(
    out: Path, rows: Blocks | Examples | Pairs, *, validation_fraction: float, seed: int, sources: int = 0
) -> dict:
    """Split the rows (seeded, as `split_indices`) and write both splits into `out`; the split's figures (with
    `sources`, a mix's: also the train split's tokens per source)."""
    train, val = split_indices(rows.count, validation_fraction, seed)
    figures, masked = {"train_rows": int(len(train)), "validation_rows": int(len(val))}, [0, 0]
    per_source = np.zeros(sources, dtype=np.int64)
    out.mkdir(parents=True)
    for name, indices in (("train", train), ("validation", val)):
        first = rows.take(indices[:1]) if len(indices) else rows.take(np.arange(1))

        def take(start: int, stop: int, indices=indices, name=name) -> pa.Table:
            table = rows.take(indices[start:stop])
            if name == "train":
                labels = table.column("labels").combine_chunks().flatten().to_numpy()
                masked[0] += int((labels == IGNORE_INDEX).sum())
                masked[1] += len(labels)
                if sources:
                    rows.source_tokens(indices[start:stop], per_source)
            return table

        nbytes = _nbytes(rows, indices)
        saved_splits.write_split(out / name, count=len(indices), nbytes=nbytes, schema=first.schema, take=take)
    saved_splits.write_dict(out, ["train", "validation"])
    figures["masked_fraction"] = masked[0] / masked[1] if masked[1] else 0.0
    if sources:
        figures["source_tokens"] = per_source.tolist()
    return figures


def _nbytes(rows: Blocks | Examples | Pairs, indices: np.ndarray) -> int:
    """The bytes of the split's columns: int32 tokens in pairs of columns (ids, labels), plus 4-byte offsets per
    column of variable rows (SFT: two columns; preference: four)."""
    if isinstance(rows, Blocks):
        return 2 * 4 * len(indices) * rows.size
    if isinstance(rows, Pairs):
        return 2 * 4 * rows.examples.tokens(Pairs.sides(indices)) + 4 * 4 * (len(indices) + 1)
    return 2 * 4 * (rows.tokens(indices) + len(indices) + 1)


def tokenized(
    spec: str, job: parts.Job, *, work: Path, heldout_fraction: float | None, workers: int, chunk_chars: int
) -> tuple[int, list[dict], float, dict]:
    """Tokenize the items of data path `spec` (less the last `heldout_fraction` of them, when given: then counted
    first) into parts under `work`; (items, the parts' summaries, seconds, the rows dropped for holding no text in
    the training part and, when given, in the held-out part). A bad line stops it with its file and line; the check
    stage has read every input before (once: see `verified`). Rows with no text are dropped by the workers, so the
    items are cut after the rows that hold the kept ones the held-out boundary leaves for training: the same items
    as `verify` counts and the eval_set stage holds out."""
    limit, dropped = None, Dropped()
    if heldout_fraction is not None:
        total = verify(spec, job.data_format, dropped=dropped)
        limit = dropped.rows_for(total - held_out_count(total, heldout_fraction))
    parts.prepare(work, parts.key(job, inputs=stored_files(spec), limit=limit, chunk_chars=chunk_chars))
    start = time.perf_counter()
    summaries = parts.tokenize(
        work,
        job,
        islice(items(spec, job.data_format, deferred=True), limit),
        total=limit if limit is not None else estimated_items(spec),
        workers=workers,
        chunk_chars=chunk_chars,
    )
    count = sum(s["items"] for s in summaries)
    if count == 0:
        raise ValueError(f"{spec}: data file is empty")
    rows = {"training_part": sum(s.get("dropped_rows", 0) for s in summaries)}
    if limit is not None:  # the file's tail, held out: eval_set's rows, whose dropped ones no worker sees
        rows["heldout_part"] = sum(1 for position in dropped.positions if position >= limit)
    return count, summaries, time.perf_counter() - start, rows


def _pad_id(tokenizer_dir: Path) -> int:
    tokenizer = light_tokenizer(tokenizer_dir) or load_tokenizer(tokenizer_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad_id if pad_id is not None else 0


def _blocks(stream: Stream | Mixed, packing, tokenizer_dir: Path) -> tuple[Blocks, dict]:
    p = packing
    rows = Blocks(stream, block_size=p.block_size, tail=p.tail, pad_id=_pad_id(tokenizer_dir))
    if rows.count < 1:
        raise ValueError(f"data.block_size: {len(stream)} tokens make no block of {p.block_size}; lower it or add text")
    return rows, {
        "blocks": rows.count,
        "tokens_dropped": rows.rest if p.tail == "drop" else 0,
        "tokens_padded": (p.block_size - rows.rest) if rows.count > rows.full else 0,
    }


COUNTS = {"sft": ("examples", "truncated_examples", "dropped_examples"), "preference": PAIR_COUNTS}


def _counts(summaries: list[dict], family: str) -> dict:
    """The parts' counts of examples (SFT) or pairs (preference), truncated and dropped ones, summed."""
    return {key: sum(s[key] for s in summaries) for key in COUNTS[family]}


def _measured(summaries: list[dict], seconds: float, workers: int) -> dict:
    """How the tokenizing went: parts made and reused, and tokens/s per core of the parts made in this run."""
    reused = sum(1 for s in summaries if s.get("reused"))
    fresh = sum(s["tokens"] for s in summaries if not s.get("reused"))
    return {
        "parts": len(summaries),
        "parts_reused": reused,
        "workers": workers,
        "tokenize_seconds": round(seconds, 3),
        "tokens_per_second_per_core": round(fresh / seconds / workers) if seconds > 0 else 0,
    }


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
    documents, rows dropped for holding no text (of the training part, and of the held-out part when it is the
    file's tail), tokens, blocks, padded and dropped tokens (text), examples, truncated and dropped examples (SFT) or
    pairs, truncated and dropped pairs (preference: a row is a pair), rows per split, the train split's masked
    fraction (of the chosen side's labels for pairs), and tokens/s (per core)."""
    p = packing
    job = parts.Job(str(tokenizer_dir), p.data_format, p.template, p.max_seq_len)
    count, summaries, seconds, dropped_rows = tokenized(
        train_file, job, work=work, heldout_fraction=heldout_fraction, workers=workers, chunk_chars=chunk_chars
    )
    indices = [s["index"] for s in summaries]
    figures: dict = {"documents": count, "tokens": sum(s["tokens"] for s in summaries), "dropped_rows": dropped_rows}
    if job.family == "text" and p.packing == "documents":
        ids = Stream([parts.array_path(work, i, "ids") for i in indices])
        lengths = Stream([parts.array_path(work, i, "lengths") for i in indices])
        starts, sizes, shape = document_rows(lengths.read(0, len(lengths)), p.block_size)
        rows = Examples(ids, ids, sizes, starts=starts)
        figures |= shape
    elif job.family == "text":
        rows, shape = _blocks(Stream([parts.array_path(work, i, "ids") for i in indices]), p, tokenizer_dir)
        figures |= shape
    else:
        rows = (Pairs if job.family == "preference" else Examples).of_parts(work, indices)
        figures |= _counts(summaries, job.family)
        if rows.count < 1:
            what = "pair lost a response" if job.family == "preference" else "example lost its response"
            raise ValueError(f"data.max_seq_len: every {what} to truncation at {p.max_seq_len} tokens")
    figures |= write(out, rows, validation_fraction=p.validation_fraction, seed=p.seed)
    return figures | _measured(summaries, seconds, workers)


def build_mix(
    out: Path, *, tokenizer_dir: Path, sources: list, packing, work: Path, workers: int, chunk_chars: int
) -> dict:
    """Write the weighted mix of `sources` (`mixing.Source`, all of one family: text or SFT) into `out`, as
    the tests' `mix_text` / `mix_instruction` build it in memory: each source is tokenized into parts of its own, the
    mix is chosen from the items' token counts, and the rows are read across the sources' parts. Figures as
    `build`'s, plus `sources` (planned and realised shares)."""
    p = packing
    if p.packing == "documents":
        raise ValueError("data.packing: documents takes data.train_file; a weighted mix (data.sources) packs blocks")
    for i, source in enumerate(sources):  # every source found before any is tokenized
        mixing.check_source(source, f"data.sources.{i}")
    counts, streams, labels, lengths, summaries, seconds, dropped_rows = [], [], [], [], [], 0.0, 0
    for i, source in enumerate(sources):
        job = parts.Job(str(tokenizer_dir), source.format, p.template, p.max_seq_len)
        folder = work / f"source_{i}"
        count, done, spent, dropped = tokenized(
            str(source.file),
            job,
            work=folder,
            heldout_fraction=None,
            workers=workers,
            chunk_chars=chunk_chars,
        )
        indices = [s["index"] for s in done]
        if job.family == "sft" and not sum(s["tokens"] for s in done):
            raise ValueError(
                f"data.max_seq_len: every example of {source.file} lost its response to truncation at {p.max_seq_len}"
            )
        streams.append(Stream([parts.array_path(folder, k, "ids") for k in indices]))
        labels.append(Stream([parts.array_path(folder, k, "labels") for k in indices]) if job.family == "sft" else None)
        length = Stream([parts.array_path(folder, k, "lengths") for k in indices])
        lengths.append(length.read(0, len(length)).astype(np.int64))
        counts.append(count)
        summaries += done
        seconds += spent
        dropped_rows += dropped["training_part"]  # a source is trained whole: no held-out part
    shares = mixing.planned_shares(sources)
    mix = mixing.choose(lengths, shares, p.seed)
    ids = Mixed(streams, lengths, mix)
    figures: dict = {"documents": len(mix) if p.data_format == "text" else sum(counts), "tokens": len(ids)}
    figures["dropped_rows"] = {"training_part": dropped_rows}
    if p.data_format == "text":
        rows, shape = _blocks(ids, p, tokenizer_dir)
        figures |= shape
    else:
        rows = Examples(ids, Mixed(labels, lengths, mix), ids.length)
        figures |= _counts(summaries, "sft")
    figures |= write(out, rows, validation_fraction=p.validation_fraction, seed=p.seed, sources=len(sources))
    items_per_source = np.bincount(mix[:, 0], minlength=len(sources)).tolist()
    figures["sources"] = mixing.report(sources, shares, figures.pop("source_tokens"), items_per_source)
    return figures | _measured(summaries, seconds, workers)
