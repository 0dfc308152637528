"""How the training data is packed into rows (`Packing`), and the rows' length checked against the model's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Packing:
    """How items become rows (text: blocks of `block_size`; alpaca, chat: examples cut at `max_seq_len`;
    preference: pairs of such examples) and how the rows are split."""

    data_format: str
    block_size: int
    tail: str
    template: str
    max_seq_len: int
    validation_fraction: float
    seed: int
    packing: str = "blocks"  # text: blocks (the stream cut) | documents (a row per document, up to block_size)


def check_length(packing: Packing, positions: int) -> None:
    """Refuse rows longer than the model has positions for (its `max_position_embeddings`)."""
    p = packing
    key, length = ("data.block_size", p.block_size) if p.data_format == "text" else ("data.max_seq_len", p.max_seq_len)
    if length > positions:
        raise ValueError(f"{key}: {length} exceeds the model's max_position_embeddings ({positions})")
