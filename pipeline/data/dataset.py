"""Tokenize and pack text (pretraining), instruction data (SFT, prompt masked) or preference pairs (two SFT
examples each) into an Arrow dataset."""

from __future__ import annotations

import hashlib
import json
import mmap
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.data.inputs import response_text
from pipeline.data.tokenizer import template_refusals

IGNORE_INDEX = -100
REQUIRED_FIELDS = {"text": (), "alpaca": ("instruction", "output"), "chat": ("messages",)}  # per data format
ALPACA_TEMPLATES = {
    "with_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    ),
    "no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:\n"
    ),
}


def encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Batched Rust-side encoding (no offsets, no Python per-token work)."""
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


DOCUMENTS_PER_CHUNK = 256  # documents encoded at a time: their Encodings and Python token lists live for one chunk


def tokenize_documents(
    tokenizer, documents: list[str], *, chunk: int = DOCUMENTS_PER_CHUNK
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate every document's tokens (with the tokenizer's BOS where it adds one) plus EOS; returns the flat
    int32 stream and each document's token count. Encoded `chunk` documents at a time into int32 arrays, so that
    the stream costs 4 bytes a token, not a Python list of ints per document; the same stream for any `chunk`."""
    eos = tokenizer.eos_token_id
    ends = () if eos is None else (eos,)
    parts, lengths = [], []
    for start in range(0, len(documents), chunk):
        pieces = encode(tokenizer, documents[start : start + chunk], add_special_tokens=True)
        sizes = np.fromiter(map(len, pieces), np.int32, count=len(pieces)) + len(ends)
        tokens = chain.from_iterable(chain(piece, ends) for piece in pieces)
        parts.append(np.fromiter(tokens, dtype=np.int32, count=int(sizes.sum())))
        lengths.append(sizes)
    if not parts:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    return np.concatenate(parts), np.concatenate(lengths)


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


def document_rows(lengths: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Documents kept whole (`data.packing: documents`): where each row starts in the token stream and its length,
    given the documents' token counts. A document of up to `block_size` tokens is one row, a longer one rows of
    `block_size` and its rest; a rest of one token (the document's EOS) predicts nothing and is left out. And the
    figures: rows, documents cut, tokens left out."""
    lengths = np.asarray(lengths, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pieces = -(-lengths // block_size)
    document = np.repeat(np.arange(len(lengths)), pieces)
    within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = firsts[document] + within * block_size
    sizes = np.minimum(block_size, lengths[document] - within * block_size)
    kept = sizes >= 2
    figures = {
        "rows": int(kept.sum()),
        "documents_cut": int((lengths > block_size).sum()),
        "tokens_dropped": int(sizes[~kept].sum()),
    }
    return starts[kept], sizes[kept], figures


def split_indices(n: int, validation_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/validation split of n rows; each side keeps the original order."""
    n_val = 0 if validation_fraction == 0 else max(1, round(n * validation_fraction))
    if n - n_val < 1:
        raise ValueError(
            f"data.validation_fraction: {n} row(s) leave nothing to train on; add data or lower data.block_size"
        )
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def alpaca_prompt(row: dict, template: str) -> str:
    if template == "alpaca":
        template = ALPACA_TEMPLATES["with_input" if row.get("input") else "no_input"]
    return template.format(instruction=row["instruction"], input=row.get("input", ""))


def alpaca_messages(row: dict) -> list[dict]:
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def sft_segments(tokenizer, row: dict, template: str) -> list[tuple[str, bool]]:
    """One example as (text, trained) segments: prompts untrained, responses (with EOS) trained."""
    return rendered_segments(tokenizer, [row], template, None)[0][0]


def rendered_segments(
    tokenizer, rows: list[dict], template: str, max_chars: int | None
) -> list[tuple[list[tuple[str, bool]], bool]]:
    """Each row's (text, trained) segments, and whether they are all of them: a conversation stops after the turn
    whose rendering passes `max_chars` characters (None: no bound). Conversations are rendered with the chat
    template a turn at a time for all rows at once (two template calls per turn, not per row and turn): turn k's
    prompt is the conversation before its k-th reply with the generation prompt, the reply is what the template
    writes after it."""
    segments: list[list[tuple[str, bool]]] = [[] for _ in rows]
    chats: dict[int, list[dict]] = {}
    for k, row in enumerate(rows):
        if "messages" in row or template == "chat":
            chats[k] = row["messages"] if "messages" in row else alpaca_messages(row)
        else:
            segments[k] = [(alpaca_prompt(row, template), False), (row["output"] + (tokenizer.eos_token or ""), True)]
    replies = {k: [i for i, m in enumerate(chat) if m["role"] == "assistant"] for k, chat in chats.items()}
    done, cut = dict.fromkeys(chats, ""), set()
    for turn in range(max(map(len, replies.values()), default=0)):
        active = [k for k in chats if turn < len(replies[k]) and k not in cut]
        ends = [replies[k][turn] for k in active]
        prompts = _render(tokenizer, [chats[k][:end] for k, end in zip(active, ends, strict=True)], True)
        fulls = _render(tokenizer, [chats[k][: end + 1] for k, end in zip(active, ends, strict=True)], False)
        for k, prompt, full in zip(active, prompts, fulls, strict=True):
            if not (prompt.startswith(done[k]) and full.startswith(prompt)):
                raise ValueError(
                    "the chat template does not render conversations incrementally; use an alpaca template"
                )
            segments[k] += [(prompt[len(done[k]) :], False), (full[len(prompt) :], True)]
            done[k] = full
            if max_chars is not None and len(full) > max_chars and turn + 1 < len(replies[k]):
                cut.add(k)
    return [(row_segments, k not in cut) for k, row_segments in enumerate(segments)]


def _render(tokenizer, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    if not conversations:
        return []
    with template_refusals():
        return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=add_generation_prompt)


RENDERED_CHARS_PER_TOKEN = 32  # a row's rendering stops past this many characters per max_seq_len token


def build_sft(tokenizer, rows: list[dict], *, template: str, max_seq_len: int) -> tuple[list, list, dict]:
    """`sft_arrays` as lists: each kept example's token ids and labels, and the counts."""
    arrays, counts = sft_arrays(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    if not len(arrays["lengths"]):
        return [], [], counts
    bounds = np.cumsum(arrays["lengths"])[:-1]
    inputs, labels = (np.split(arrays[name], bounds) for name in ("ids", "labels"))
    return [a.tolist() for a in inputs], [a.tolist() for a in labels], counts


def sft_arrays(tokenizer, rows: list[dict], *, template: str, max_seq_len: int) -> tuple[dict[str, np.ndarray], dict]:
    """Tokenize SFT rows into int32 arrays: `ids` and `labels` (-100 on prompt tokens) of the kept examples end to
    end, and their `lengths`; each example is truncated to max_seq_len, and dropped when truncation leaves it no
    trained token. The counts: examples, truncated and dropped ones (see `_examples`)."""
    arrays, truncated, kept = _examples(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    counts = {"examples": len(rows), "truncated_examples": int(truncated.sum()), "dropped_examples": int((~kept).sum())}
    return arrays, counts


SFT_ARRAYS = ("ids", "labels", "lengths")
PAIR_COUNTS = ("pairs", "truncated_pairs", "dropped_pairs")
PAIR_COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")  # a preference row: chosen, rejected


def preference_arrays(
    tokenizer, rows: list[dict], *, template: str, max_seq_len: int
) -> tuple[dict[str, np.ndarray], dict]:
    """Tokenize preference pairs into `sft_arrays`' arrays, two examples per kept pair, chosen then rejected: each side
    rendered as SFT renders its row (`pair_examples`), every token before the response masked, cut at max_seq_len
    keeping its start. A pair is dropped when either side keeps no trained token, so that the sides travel together.
    The counts: pairs, truncated pairs (either side cut, dropped or not) and dropped pairs."""
    if any(row.get("messages") is not None for row in rows) and not tokenizer.chat_template:
        raise ValueError(
            "data.format: preference rows with 'messages' need a tokenizer with a chat template; this one has none"
        )
    arrays, truncated, kept = _examples(
        tokenizer, pair_examples(rows), template=template, max_seq_len=max_seq_len, final_reply_only=True
    )
    pair_kept = kept[0::2] & kept[1::2]
    keep = np.repeat(pair_kept, 2)[kept]  # of the examples kept, those whose other side is kept too
    tokens = np.repeat(keep, arrays["lengths"])
    arrays = {"ids": arrays["ids"][tokens], "labels": arrays["labels"][tokens], "lengths": arrays["lengths"][keep]}
    counts = {
        "pairs": len(rows),
        "truncated_pairs": int((truncated[0::2] | truncated[1::2]).sum()),
        "dropped_pairs": int((~pair_kept).sum()),
    }
    return arrays, counts


def pair_examples(rows: list[dict]) -> list[dict]:
    """Each preference pair as the two SFT rows it trains on, chosen then rejected: a `prompt` becomes an alpaca
    row's instruction, `messages` a conversation whose last assistant turn is the response."""
    examples = []
    for row in rows:
        for side in ("chosen", "rejected"):
            response = response_text(row[side])
            if row.get("messages") is not None:
                examples.append({"messages": [*row["messages"], {"role": "assistant", "content": response}]})
            else:
                examples.append({"instruction": row["prompt"], "output": response})
    return examples


def _examples(
    tokenizer, rows: list[dict], *, template: str, max_seq_len: int, final_reply_only: bool = False
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """SFT rows as int32 arrays (`ids`, `labels`, `lengths`) of the kept examples, and per row whether it was
    truncated and whether it was kept. With `final_reply_only`, only a conversation's last reply is trained (the
    turns before it are its prompt). DOCUMENTS_PER_CHUNK rows at a time are rendered (`rendered_segments`, whose
    rendering stops past RENDERED_CHARS_PER_TOKEN x max_seq_len characters, so long conversations cost no more than
    their beginning; a row cut there that still fits is rendered again whole, so the result is exact), encoded in
    one batch (Rust-side), then masked and cut with array operations."""
    if template == "chat" and not tokenizer.chat_template:
        raise ValueError("data.prompt_template: 'chat' needs a tokenizer with a chat template; this one has none")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.backend_tokenizer.encode("x", add_special_tokens=True).ids[:1] == [bos]
    start = [bos] if adds_bos else []
    groups, truncated, kept = [], [np.zeros(0, bool)], [np.zeros(0, bool)]
    for first in range(0, len(rows), DOCUMENTS_PER_CHUNK):
        group = rows[first : first + DOCUMENTS_PER_CHUNK]
        rendered = rendered_segments(tokenizer, group, template, RENDERED_CHARS_PER_TOKEN * max_seq_len)
        pieces = iter(encode(tokenizer, [text for segments, _ in rendered for text, _ in segments], False))
        encoded = []
        for row, (segments, whole) in zip(group, rendered, strict=True):
            ids = [next(pieces) for _ in segments]
            if not whole and len(start) + sum(map(len, ids)) <= max_seq_len:  # cut, yet short: render it all
                segments, whole = sft_segments(tokenizer, row, template), True
                ids = encode(tokenizer, [text for text, _ in segments], False)
            trained = [flag for _, flag in segments]
            if final_reply_only:  # a rendering cut before its last reply trains nothing: that reply lies past the cut
                trained = [flag and whole and i == len(trained) - 1 for i, flag in enumerate(trained)]
            encoded.append((ids, trained))
        arrays, cut, left = _masked_examples(encoded, start, max_seq_len)
        groups.append(arrays)
        truncated.append(cut)
        kept.append(left)
    empty = np.zeros(0, np.int32)
    arrays = {name: np.concatenate([g[name] for g in groups]) if groups else empty for name in SFT_ARRAYS}
    return arrays, np.concatenate(truncated), np.concatenate(kept)


def _masked_examples(
    encoded: list[tuple[list[list[int]], list[bool]]], start: list[int], max_seq_len: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Examples from their encoded segments (with whether each is trained): `start` + the segments' tokens, labels
    -100 on untrained segments, cut to max_seq_len; those left without a trained token dropped. The arrays, and per
    example whether it was truncated and whether it was kept."""
    pieces = [piece for ids, _ in encoded for piece in ids]
    piece_lengths = np.fromiter(map(len, pieces), np.int64, count=len(pieces))
    flat = np.fromiter(chain.from_iterable(pieces), np.int32, count=int(piece_lengths.sum()))
    trained = np.fromiter(chain.from_iterable(flags for _, flags in encoded), bool, count=len(pieces))
    flat_labels = np.where(np.repeat(trained, piece_lengths), flat, np.int32(IGNORE_INDEX)).astype(np.int32)
    piece_starts = np.concatenate([[0], np.cumsum(piece_lengths)])
    per_example = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in encoded], dtype=np.int64)])
    first, total = piece_starts[per_example[:-1]], piece_starts[per_example[1:]] - piece_starts[per_example[:-1]]
    body = np.minimum(total, max_seq_len - len(start))  # tokens kept after `start`
    trained_before = np.concatenate([[0], np.cumsum(flat_labels != IGNORE_INDEX)])
    kept = trained_before[first + body] > trained_before[first]
    first, body = first[kept], body[kept]
    starts = np.concatenate([[0], np.cumsum(body)])[:-1]
    take = np.arange(int(body.sum())) + np.repeat(first - starts, body)
    ids, labels = flat[take], flat_labels[take]
    if start:
        ids, labels = np.insert(ids, starts, start[0]), np.insert(labels, starts, IGNORE_INDEX)
    arrays = {"ids": ids, "labels": labels, "lengths": (body + len(start)).astype(np.int32)}
    return arrays, total + len(start) > max_seq_len, kept


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


class SplitRows:
    """One split of a dataset `save_splits` (or `streamed.write`) wrote, read with pyarrow alone (memory-mapped):
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
    """The Arrow stream files of one split `save_splits` (or save_to_disk) wrote, in order."""
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
