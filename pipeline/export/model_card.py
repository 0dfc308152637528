"""Hugging Face model cards (README.md: a YAML header, then Markdown) for the adapter and the merged model, made from
the pipeline's own files: the config that produced them, the data, the training and merge figures, and the
commands that load them. Only reproducible figures go in (no timings), so that a re-run writes the same bytes."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.core.atomic import atomic_path
from pipeline.evaluation.results import TASKS_KEY, set_figures

CARD = "README.md"
TRAINING_FIGURES = ("steps", "final_train_loss", "val_loss", "val_perplexity", "val_preference_accuracy",
                    "val_reward_margin", "trainable_parameters", "precision", "world_size", "zero_stage")  # fmt: skip
DATASET_FIGURES = ("documents", "pairs", "dropped_pairs", "tokens", "train_rows", "validation_rows", "masked_fraction")
CONFIG_SECTIONS = ("model", "data", "lora", "train", "deepspeed")


def _table(figures: dict, keys: tuple[str, ...]) -> list[str]:
    rows = [f"| {key} | {figures[key]} |" for key in keys if figures.get(key) is not None]
    return ["| figure | value |", "|---|---|", *rows] if rows else ["(not recorded)"]


def _data(params: dict, dataset: dict) -> list[str]:
    data = params["data"]
    if data["sources"]:
        lines = [
            "A weighted mix (`data.sources`); share of tokens planned by weight and realised in the train split:",
            "",
            "| source | file | format | weight | planned | realised |",
            "|---|---|---|---|---|---|",
        ]
        by_file = {figures.get("file"): (name, figures) for name, figures in dataset.get("sources", {}).items()}
        for source in data["sources"]:
            name, share = by_file.get(source["file"], (Path(source["file"]).stem, {}))
            lines.append(
                f"| {name} | `{source['file']}` | {source['format']} | {source['weight']} | "
                f"{share.get('planned_share', '')} | {share.get('realised_share', '')} |"
            )
    else:
        lines = [f"`{data['train_file']}` ({dataset.get('format', data['format'])})."]
    return [*lines, "", *_table(dataset, DATASET_FIGURES)]


OBJECTIVES = {"dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO"}


def _objective(train: dict) -> list[str]:
    """What the adapter was trained to do: next-token prediction, or a preference objective with its settings."""
    kind, start = train.get("objective", "lm"), train.get("init_adapter")
    started = f", starting from the adapter `{start}` (`train.init_adapter`)" if start else ""
    if kind == "lm":
        return [f"Next-token prediction on the data above (`train.objective: lm`){started}."]
    settings = f"beta {train['beta']}" + (f", gamma {train['simpo_gamma']}" if kind == "simpo" else "")
    reference = ""
    if kind == "dpo":
        reference = " against " + ("that adapter's model" if start else "the base with the adapter disabled")
        reference += " as the reference"
    return [
        f"Preference tuning with {OBJECTIVES[kind]} ({settings}) on pairs of a chosen and a rejected response"
        f"{started}{reference} (`train.objective: {kind}`)."
    ]


def _evaluation(evaluation: dict) -> list[str]:
    """eval.json as tables: bits per byte per set, then task scores with standard errors, for every model."""
    tasks = evaluation.get(TASKS_KEY, {})
    sets = set_figures(evaluation)
    lines = ["| set | model | bits per byte | perplexity |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {model} | {v['bits_per_byte']} | {v['perplexity']} |"
        for name, by_model in sets.items()
        for model, v in by_model.items()
    ]
    if tasks:
        lines += ["", "| task | model | metric | value | standard error | documents |", "|---|---|---|---|---|---|"]
        for task, by_model in tasks.items():
            for model, figures in by_model.items():
                for metric, value in figures.items():
                    if metric != "samples" and not metric.endswith("_stderr"):
                        stderr = figures.get(f"{metric}_stderr")
                        lines.append(f"| {task} | {model} | {metric} | {value} | {stderr} | {figures['samples']} |")
    return lines


def render(
    *, kind: str, params: dict, dataset: dict, training: dict, merge: dict | None = None, evaluation: dict | None = None
) -> str:
    """The card of the `kind` ("adapter" or "merged") folder; `params` is the composed config (params.yaml);
    `evaluation` (eval.json) where it exists, as when `python -m pipeline card` renders a card for publishing."""
    base = params["model"]["path"]
    header = {
        "base_model": base,
        "library_name": "peft" if kind == "adapter" else "transformers",
        "license": "other",  # placeholder: the base model's and the data's licenses decide
        "pipeline_tag": "text-generation",
        "tags": ["lora", "deepspeed", "dvc", f"data-{params['data']['format']}"]
        + ([params["train"]["objective"]] if params["train"].get("objective", "lm") != "lm" else [])
        + (["peft"] if kind == "adapter" else ["merged"]),
    }
    folder = "artifacts/adapter" if kind == "adapter" else "artifacts/merged"
    title = "LoRA adapter" if kind == "adapter" else "Merged model (base + LoRA adapter folded in)"
    config = yaml.safe_dump({k: params[k] for k in CONFIG_SECTIONS}, sort_keys=False, allow_unicode=True).strip()
    lines = [
        "---",
        yaml.safe_dump(header, sort_keys=False, allow_unicode=True).strip(),
        "---",
        "",
        f"# {title} of `{base}`",
        "",
        "Made by this project's DVC pipeline (`dvc repro`); the license above is a placeholder.",
        "",
        "## Data",
        "",
        *_data(params, dataset),
        "",
        "## Objective",
        "",
        *_objective(params["train"]),
        "",
        "## Configuration",
        "",
        "The part of `params.yaml` that produced this model:",
        "",
        "```yaml",
        config,
        "```",
        "",
        "## Evaluation",
        "",
        "Training (validation loss on held-out blocks of the training data):",
        "",
        *_table(training, TRAINING_FIGURES),
    ]
    if merge is not None:
        lines += [
            "",
            "Merge check (merged vs base + adapter logits on fixed tokens):",
            "",
            *_table(merge, tuple(merge)),
        ]
    if evaluation is not None:
        lines += ["", "Held-out text and downstream tasks (the evaluate stage, `metrics/eval.json`):", ""]
        lines += _evaluation(evaluation)
    else:
        lines += [
            "",
            "Bits per byte and task accuracy of the base, base + adapter and merged models: `metrics/eval.json`",
            "(`dvc metrics show`), written by the evaluate stage after this card; `python -m pipeline card`",
            "renders this card with them.",
        ]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        *(_load_adapter(folder, params["tokenizer"]) if kind == "adapter" else _load_merged(folder)),
        "```",
        "",
        "```bash",
        "python -m pipeline chat --model "
        + (f"artifacts/base --adapter {folder}" if kind == "adapter" else folder)
        + "   # talk to it",
        "python -m pipeline export --to gguf --model artifacts/merged --out model.gguf   # llama.cpp / Ollama",
        "```",
        "",
    ]
    return "\n".join(lines)


def _load_adapter(folder: str, tokenizer: dict) -> list[str]:
    resize = f"base.resize_token_embeddings(len(tokenizer), pad_to_multiple_of={tokenizer['pad_to_multiple_of']})"
    return [
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
        'base = AutoModelForCausalLM.from_pretrained("artifacts/base")  # the pipeline\'s import of base_model',
        *([f"{resize}  # the vocabulary was extended"] if tokenizer["extend"] else []),
        f'model = PeftModel.from_pretrained(base, "{folder}")',
    ]


def _load_merged(folder: str) -> list[str]:
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{folder}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
    ]


def write(folder: Path, text: str) -> None:
    """README.md into a model folder (atomically)."""
    with atomic_path(Path(folder) / CARD) as tmp:
        tmp.write_text(text, encoding="utf-8")
