"""`data.packing: documents`: every document kept whole in rows of its own, instead of the stream cut in blocks."""

from __future__ import annotations

import numpy as np


def document_rows(lengths: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Where each row starts in the token stream and its length, given the documents' token counts. A document of
    up to `block_size` tokens is one row, a longer one rows of `block_size` and its rest; a rest of one token (the
    document's EOS) predicts nothing and is left out. And the figures: rows, documents cut, tokens left out."""
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
