"""How the training data is packed (`Packing`) and the weighted mix of `data.sources`, built in memory; one training
file (of any size) is streamed instead (`streamed`)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.data import mixing


@dataclass(frozen=True)
class Packing:
    """How items become rows (text: blocks of `block_size`; alpaca, chat: examples cut at `max_seq_len`) and how
    the rows are split."""

    data_format: str
    block_size: int
    tail: str
    template: str
    max_seq_len: int
    validation_fraction: float
    seed: int


def check_length(packing: Packing, positions: int) -> None:
    """Refuse rows longer than the model has positions for (its `max_position_embeddings`)."""
    p = packing
    key, length = ("data.block_size", p.block_size) if p.data_format == "text" else ("data.max_seq_len", p.max_seq_len)
    if length > positions:
        raise ValueError(f"{key}: {length} exceeds the model's max_position_embeddings ({positions})")


def build_mix(tokenizer, sources: list, packing: Packing) -> tuple[dict[str, pa.Table], dict]:
    """The weighted mix of `data.sources` entries (every file read and checked before any tokenizing)."""
    p = packing
    resolved = mixing.resolve(sources)
    contents = [mixing.read_source(s, f"data.sources.{i}") for i, s in enumerate(resolved)]
    if p.data_format == "text":
        return mixing.mix_text(
            tokenizer,
            resolved,
            contents,
            block_size=p.block_size,
            tail=p.tail,
            validation_fraction=p.validation_fraction,
            seed=p.seed,
        )
    return mixing.mix_instruction(
        tokenizer,
        resolved,
        contents,
        template=p.template,
        max_seq_len=p.max_seq_len,
        validation_fraction=p.validation_fraction,
        seed=p.seed,
    )
