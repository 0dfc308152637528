"""eval.json's layout: figures per evaluation set and model, with the task scores, the preference figures and the
adapter's variant beside them under keys of their own."""

from __future__ import annotations

TASKS_KEY = "tasks"  # eval.json: task accuracies beside the eval sets' bits per byte
VARIANT_KEY = "variant"  # eval.json: what produced the adapter (DoRA, LoRA+, QLoRA)
PREFERENCE_KEY = "preference"  # eval.json: accuracy on held-out preference pairs (eval.preference_sets)
RESERVED = (TASKS_KEY, VARIANT_KEY, PREFERENCE_KEY)  # no eval set may take these names (config.RESERVED_SET_NAMES)


def set_figures(evaluation: dict) -> dict:
    """eval.json's figures per evaluation set, without the task scores, preference figures and variant beside them."""
    return {name: by_model for name, by_model in evaluation.items() if name not in RESERVED}
