"""SFT examples and preference pairs tokenized into int32 arrays: prompt tokens masked (-100), each example cut at
max_seq_len, those left without a trained token dropped; a pair's two sides kept or dropped together."""

from __future__ import annotations

from itertools import chain

import numpy as np

from pipeline.data.encoding import DOCUMENTS_PER_CHUNK, encode
from pipeline.data.inputs import response_text
from pipeline.data.templates import rendered_segments, sft_segments

IGNORE_INDEX = -100


RENDERED_CHARS_PER_TOKEN = 32  # a row's rendering stops past this many characters per max_seq_len token


def sft_arrays(tokenizer, rows: list[dict], *, template: str, max_seq_len: int) -> tuple[dict[str, np.ndarray], dict]:
    """Tokenize SFT rows into int32 arrays: `ids` and `labels` (-100 on prompt tokens) of the kept examples end to
    end, and their `lengths`; each example is truncated to max_seq_len, and dropped when truncation leaves it no
    trained token. The counts: examples, truncated and dropped ones (see `_examples`)."""
    arrays, truncated, kept = _examples(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    counts = {"examples": len(rows), "truncated_examples": int(truncated.sum()), "dropped_examples": int((~kept).sum())}
    return arrays, counts


def completion_arrays(
    tokenizer, rows: list[dict], *, template: str, max_seq_len: int
) -> tuple[dict[str, np.ndarray], dict]:
    """`sft_arrays` of prompt-completion rows (`completion_examples`): only the completion is trained, a
    conversational prompt's assistant turns masked with the rest of it, as TRL's completion mask masks them."""
    _need_chat_template(tokenizer, rows, "prompt_completion rows with a conversational 'prompt'")
    examples = completion_examples(rows)
    arrays, truncated, kept = _examples(
        tokenizer, examples, template=template, max_seq_len=max_seq_len, final_reply_only=True
    )
    counts = {"examples": len(rows), "truncated_examples": int(truncated.sum()), "dropped_examples": int((~kept).sum())}
    return arrays, counts


def arrays_for(data_format: str):
    """The builder of a format's examples: `preference_arrays`, `completion_arrays` or `sft_arrays`."""
    return {"preference": preference_arrays, "prompt_completion": completion_arrays}.get(data_format, sft_arrays)


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
    _need_chat_template(tokenizer, rows, "preference rows with a conversation ('messages', TRL's or Anthropic HH's)")
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


def _need_chat_template(tokenizer, rows: list[dict], what: str) -> None:
    conversations = any(row.get("messages") is not None or isinstance(row.get("prompt"), list) for row in rows)
    if conversations and not tokenizer.chat_template:
        raise ValueError(f"data.format: {what} need a tokenizer with a chat template; this one has none")


def response_example(prompt: str | list[dict], response: str) -> dict:
    """The SFT row a prompt and its response train as: a string prompt is an alpaca row's instruction, a
    conversation gets the response as its last assistant turn."""
    if isinstance(prompt, list):
        return {"messages": [*prompt, {"role": "assistant", "content": response}]}
    return {"instruction": prompt, "output": response}


def pair_examples(rows: list[dict]) -> list[dict]:
    """Each preference pair as the two SFT rows it trains on, chosen then rejected (`response_example`; `messages`
    is the prompt where a row has them)."""
    examples = []
    for row in rows:
        prompt = row["messages"] if row.get("messages") is not None else row["prompt"]
        examples += [response_example(prompt, response_text(row[side])) for side in ("chosen", "rejected")]
    return examples


def completion_examples(rows: list[dict]) -> list[dict]:
    """Each prompt-completion row (`formats.canonical`'s form) as the SFT row it trains on (`response_example`)."""
    return [response_example(row["prompt"], row["completion"]) for row in rows]


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
