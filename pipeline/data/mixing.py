"""Weighted mixing of several training files (`data.sources`): each source gives its weight's share of the mixed
tokens. The mix is the largest one that repeats nothing: its size is set by the source with the least text for its
weight, and the others contribute documents (or examples) drawn by a seeded shuffle until their quota is reached;
the chosen items are then shuffled together, so that packed blocks and batches hold every source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.inputs import data_files, kind, lines


@dataclass(frozen=True)
class Source:
    """One file of the mix; `name` (the file's stem, numbered when two share it) keys its figures."""

    name: str
    file: Path
    format: str
    weight: float


def resolve(entries: list) -> list[Source]:
    """Sources from the config's {file, format, weight} entries, with unique names."""
    stems = [Path(e.file).stem for e in entries]
    return [
        Source(stem if stems.count(stem) == 1 else f"{stem}_{i}", Path(e.file), e.format, float(e.weight))
        for i, (stem, e) in enumerate(zip(stems, entries, strict=True))
    ]


def check_source(source: Source, key: str) -> None:
    """Refuse a source whose path names no file, or a text source whose plain file holds JSON rows."""
    try:
        files = data_files(source.file)
    except FileNotFoundError:
        raise FileNotFoundError(f"{key}.file: {source.file} not found") from None
    if source.format == "text":
        for path in files:
            refuse_json_text(path, key)


def refuse_json_text(path: Path, key: str) -> None:
    """A plain text file whose first line is a JSON object was meant as rows: say so, rather than train on JSON."""
    if kind(path) != "text":
        return
    number, line = next(((n, line) for n, line in lines(path) if line.strip()), (0, ""))
    try:
        is_object = isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        is_object = False
    if is_object:
        raise ValueError(
            f"{path}:{number}: a JSON object in a text source; expected plain text (one document per line), "
            f"or {key}.format alpaca/chat"
        )


def planned_shares(sources: list[Source]) -> np.ndarray:
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    return weights / weights.sum()


def choose(lengths: list[np.ndarray], shares: np.ndarray, seed: int) -> np.ndarray:
    """(source, item) rows of the mix in their mixed order, an int64 array [k, 2]. Source i brings `shares[i]` x
    budget tokens, budget = min_i(tokens_i / shares[i]); it takes the items of a seeded permutation until its quota
    is reached."""
    rng = np.random.default_rng(seed)
    budget = min(float(length.sum()) / share for length, share in zip(lengths, shares, strict=True))
    picked = []
    for i, (length, share) in enumerate(zip(lengths, shares, strict=True)):
        order = rng.permutation(len(length))
        reached = np.cumsum(length[order]) >= share * budget * (1 - 1e-12)
        count = int(np.argmax(reached)) + 1 if reached.any() else len(length)
        picked.append(np.stack([np.full(count, i, dtype=np.int64), order[:count].astype(np.int64)], axis=1))
    mix = np.concatenate(picked)
    return mix[rng.permutation(len(mix))]


def report(sources: list[Source], shares: np.ndarray, train_tokens: list[int], items: list[int]) -> dict:
    """Per source: its weight, its planned share of tokens, the share its tokens have in the train split, and how
    many tokens and items (documents, examples) it gave."""
    total = max(sum(train_tokens), 1)
    return {
        s.name: {
            "file": str(s.file),
            "weight": s.weight,
            "planned_share": round(float(share), 6),
            "realised_share": round(tokens / total, 6),
            "train_tokens": int(tokens),
            "items": int(n),
        }
        for s, share, tokens, n in zip(sources, shares, train_tokens, items, strict=True)
    }
