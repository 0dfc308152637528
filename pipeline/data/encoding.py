"""Text -> token ids, encoded in batches on the Rust side: texts one by one, or documents into one int32 stream."""

from __future__ import annotations

from itertools import chain

import numpy as np


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
