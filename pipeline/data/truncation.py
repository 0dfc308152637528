"""How much of the instruction data (alpaca, chat) or preference pairs data.max_seq_len cuts: the share of examples
(pairs) truncated and dropped (nothing left to train on), and the length that would keep most of them whole. The
check stage warns from the first rows (tokenized as cache_dataset will), cache_dataset from all of them."""

from __future__ import annotations

import numpy as np

SAMPLE_ROWS = 512  # the check stage's sample: the first rows of the training data
SHARE = 0.05  # a warning when more than this share of the examples is truncated or dropped
KEPT_WHOLE = 0.95  # the length suggested keeps this share of the sampled examples whole
UNBOUNDED = 1 << 20  # tokens: the length examples are measured at, uncut


def counts_of(figures: dict) -> tuple[str, int, int, int] | None:
    """(what, how many, truncated, dropped) from cache_dataset's figures or `sample`'s; None for text."""
    for what in ("examples", "pairs"):
        if what in figures:
            return what, figures[what], figures[f"truncated_{what}"], figures[f"dropped_{what}"]
    return None


def sample(tokenizer, rows: list[dict], *, data_format: str, template: str, max_seq_len: int) -> dict:
    """cache_dataset's counts for `rows` (examples or pairs, truncated, dropped), and `kept_whole_at`: the tokens
    that keep KEPT_WHOLE of them whole (a pair's longer side)."""
    from pipeline.data.examples import arrays_for

    build = arrays_for(data_format)
    _, counts = build(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    arrays, _ = build(tokenizer, rows, template=template, max_seq_len=UNBOUNDED)
    lengths = arrays["lengths"]
    if data_format == "preference":
        lengths = np.maximum(lengths[0::2], lengths[1::2])
    whole = int(np.ceil(np.quantile(lengths, KEPT_WHOLE))) if len(lengths) else max_seq_len
    return {**counts, "kept_whole_at": whole}


def warnings(figures: dict, *, max_seq_len: int, sampled: bool) -> list[str]:
    """A warning where data.max_seq_len truncates or drops more than SHARE of the examples (pairs), with the length
    that keeps most of them whole where the figures hold it."""
    found = counts_of(figures)
    if found is None:
        return []
    what, total, truncated, dropped = found
    if not total or truncated <= SHARE * total:
        return []
    return [
        f"data.max_seq_len={max_seq_len} cuts {truncated} of {_scope(total, what, sampled)} short "
        f"({truncated / total:.0%}), {dropped} of them left with no response token to train on (dropped); "
        f"{_fix(figures, max_seq_len)}"
    ]


def refusal(figures: dict, *, max_seq_len: int, sampled: bool) -> str | None:
    """Why training cannot go on: every example (pair) would lose its response; None where some keep theirs."""
    found = counts_of(figures)
    if found is None or not found[1] or found[3] < found[1]:
        return None
    what, total = found[0], found[1]
    return (
        f"data.max_seq_len={max_seq_len}: every one of {_scope(total, what, sampled)} loses its response (its prompt "
        f"fills {max_seq_len} tokens); {_fix(figures, max_seq_len)}"
    )


def _scope(total: int, what: str, sampled: bool) -> str:
    return f"the first {total} {what} (a sample)" if sampled else f"all {total} {what} of data.train_file"


def _fix(figures: dict, max_seq_len: int) -> str:
    whole = figures.get("kept_whole_at", 0)
    return f"-S data.max_seq_len={whole} keeps {KEPT_WHOLE:.0%} of them whole" if whole > max_seq_len else "raise it"
