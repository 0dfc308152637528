"""The training data as configured: one file (less its held-out part) or a weighted mix of sources, tokenized, packed
and split into train/validation tables."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.data import mixing
from pipeline.data.dataset import build_instruction, build_pretraining
from pipeline.data.textio import held_out, read_data


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


def training_items(*, train_file: str, data_format: str, heldout_file: str, heldout_fraction: float) -> list:
    """The training file's documents (or rows), less the held-out part when it is also the held-out file."""
    items = read_data(train_file, data_format)
    return held_out(items, heldout_fraction)[0] if heldout_file == train_file else items


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


def build(
    tokenizer, *, sources: list, train_file: str, heldout_file: str, heldout_fraction: float, packing: Packing
) -> tuple[dict[str, pa.Table], dict]:
    """The train/validation tables and their statistics: of the mix of `sources` where there are any, else of the
    training file."""
    p = packing
    if sources:
        return build_mix(tokenizer, sources, p)
    items = training_items(
        train_file=train_file, data_format=p.data_format, heldout_file=heldout_file, heldout_fraction=heldout_fraction
    )
    if p.data_format == "text":
        return build_pretraining(
            tokenizer,
            items,
            block_size=p.block_size,
            tail=p.tail,
            validation_fraction=p.validation_fraction,
            seed=p.seed,
        )
    return build_instruction(
        tokenizer,
        items,
        template=p.template,
        max_seq_len=p.max_seq_len,
        validation_fraction=p.validation_fraction,
        seed=p.seed,
    )
