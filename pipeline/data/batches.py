"""Rows of a cached dataset as the model trains on them: padded batches, packed sequences, next-token targets."""

from __future__ import annotations

import itertools

from pipeline.core.imports import torch
from pipeline.data.examples import IGNORE_INDEX


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The next-token target of each position (IGNORE_INDEX at the last)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


WIDTHS_AN_OCTAVE = 8  # bucketed widths between two powers of two: <= 12.5% padding, <= 8 compiled graphs an octave
SHORTEST_WIDTH = 64


def bucketed_width(width: int) -> int:
    """The width a batch of `width` positions is padded to where the layers are compiled for static shapes: the next
    multiple of 1/8 of the power of two at or below it (1,900 -> 1,920; 2,048 stays), at least 64. A few shapes
    recur, each with a static graph: on torch 2.11 the graph for any length cost the host about twice as much a
    layer call, and DPO's pairs, whose length changes every step, waited for the host half of each step on an H200."""
    if width <= SHORTEST_WIDTH:
        return SHORTEST_WIDTH
    step = max(1, (1 << (width.bit_length() - 1)) // WIDTHS_AN_OCTAVE)
    return -(-width // step) * step


def collate(rows: list, pad_id: int, *, bucketed: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad variable-length rows into one batch (transformers' usual form), with `bucketed` to
    `bucketed_width`. No attention mask: with right padding a causal model never lets a real token see a pad, and
    without a mask SDPA takes its causal kernel instead of materialising the mask (less memory, faster)."""
    width = max(len(r["input_ids"]) for r in rows)
    width = bucketed_width(width) if bucketed else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.as_tensor(row["input_ids"])
        labels[i, :n] = torch.as_tensor(row["labels"])
    return {"input_ids": ids, "labels": labels}


def pack(rows: list, pad_id: int, *, varlen: bool = False, bucketed: bool = False) -> dict:
    """The micro-batch as the model trains on it: rows of one length (packed text blocks) as they are; rows of
    several lengths (SFT) end to end in one sequence without padding, positions restarting at each row (from
    which transformers builds a block-diagonal causal mask: no row sees another) and each row's next-token
    targets (its last position predicts nothing). The same loss over the same targets as `collate`'s padded
    batch, without computing the pads (tests/unit/kernels/test_fused_loss.py). Needs the model's `use_cache` off (as
    pipeline.model.lora loads it): transformers detects packed rows only without a cache.

    With `varlen` (flash-attention), also each row's bounds as flash-attn's variable-length kernel takes them
    (`cu_seq_lens_q/k`: where each row starts, then the total; `max_length_q/k`): transformers then builds no mask
    and no row sees another, without reading the positions back from the device in every layer.

    With `bucketed`, the batch is `bucketed_width` wide: padded rows, or after the packed rows one more of pads,
    which predicts nothing."""
    if len({len(r["input_ids"]) for r in rows}) == 1:
        return collate(rows, pad_id, bucketed=bucketed)
    total = sum(len(r["input_ids"]) for r in rows)
    if bucketed and bucketed_width(total) > total:
        pads = bucketed_width(total) - total
        rows = [*rows, {"input_ids": [pad_id] * pads, "labels": [IGNORE_INDEX] * pads}]
    ids = torch.cat([torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows])[None]
    positions = torch.cat([torch.arange(len(r["input_ids"])) for r in rows])[None]
    targets = torch.cat([shifted(torch.as_tensor(r["labels"], dtype=torch.long)[None])[0] for r in rows])[None]
    # labels too: transformers' forward computes a loss only when given labels, and then takes shift_labels
    packed = {"input_ids": ids, "position_ids": positions, "labels": targets, "shift_labels": targets}
    if varlen:
        lengths = [len(r["input_ids"]) for r in rows]
        starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        packed |= {"cu_seq_lens_q": starts, "cu_seq_lens_k": starts}
        packed |= {"max_length_q": max(lengths), "max_length_k": max(lengths)}
    return packed


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """The positions of `batch` (collate's or pack's) that have a next-token target."""
    targets = batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]
    return int((targets != IGNORE_INDEX).sum())


def on_device(batch: dict, device) -> dict:
    """The batch's tensors on `device`; to a GPU from pinned memory without waiting (a copy from pageable memory
    waits until the GPU has run everything queued before it, so the host stops queueing)."""
    if torch.device(device).type != "cuda":
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return {
        k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }
