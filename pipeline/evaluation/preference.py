"""Held-out preference pairs (`eval.preference_sets`): how often a model finds the chosen response likelier than the
rejected one (`preference_accuracy`: the summed log-probabilities of the response tokens, the prompt masked, as
training tokenizes it), by how much on average (`mean_margin`, nats), and for a tuned model how often its implicit
DPO reward, its log-probability less the base's, ranks the chosen response first (`reward_accuracy`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def load_pairs(
    tokenizer, path: Path, *, template: str, max_seq_len: int, key: str, max_bytes: int | None = None
) -> list[dict]:
    """The pairs of a preference data path (any form and container `data.format=preference` reads) as training rows
    (`input_ids`, `labels`, `rejected_input_ids`, `rejected_labels`), tokenized and cut as cache_dataset does; with
    `max_bytes`, the first pairs whose chosen responses fit in that many UTF-8 bytes (at least one). A bad row is
    refused with `key`, file and line."""
    from pipeline.data.examples import preference_arrays
    from pipeline.data.inputs import data_files, items

    try:
        data_files(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{key}: {path} not found; expected preference pairs (docs/data.md)") from None
    rows, total = [], 0
    for row in items(path, "preference"):
        total += len(row["chosen"].encode("utf-8"))
        if rows and max_bytes is not None and total > max_bytes:
            break
        rows.append(row)
    if not rows:
        raise ValueError(f"{key}: {path}: data file is empty")
    arrays, _ = preference_arrays(tokenizer, rows, template=template, max_seq_len=max_seq_len)
    bounds = np.cumsum(arrays["lengths"])[:-1]
    ids, labels = np.split(arrays["ids"], bounds), np.split(arrays["labels"], bounds)
    if not ids:
        raise ValueError(f"{key}: {path} has no pair left after truncation at data.max_seq_len={max_seq_len}")
    return [
        {"input_ids": ids[k], "labels": labels[k], "rejected_input_ids": ids[k + 1], "rejected_labels": labels[k + 1]}
        for k in range(0, len(ids), 2)
    ]


def pair_logps(model, pairs: list[dict], *, batch_size: int, pad_id: int) -> np.ndarray:
    """[pairs, 2]: the chosen and the rejected response's summed log-probability under `model`."""
    from pipeline.training.preference import pair_batch, response_logps

    found = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            rows = pairs[start : start + batch_size]
            batch = {k: v.to(model.device) for k, v in pair_batch(rows, pad_id).items()}
            logps, _ = response_logps(model, batch)
            found.append(logps.view(2, len(rows)).T.double().cpu().numpy())
    return np.concatenate(found)


def figures(logps: np.ndarray, base: np.ndarray | None = None) -> dict[str, float]:
    """The pairs' figures from `pair_logps`; `base` (the base model's) adds the implicit reward's accuracy."""
    margin = logps[:, 0] - logps[:, 1]
    found = {
        "pairs": len(logps),
        "preference_accuracy": float((margin > 0).mean()),
        "mean_margin": float(margin.mean()),
    }
    if base is not None:
        found["reward_accuracy"] = float((margin - (base[:, 0] - base[:, 1]) > 0).mean())
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in found.items()}
