"""The pipeline's results as text under 100 columns: the evaluation table, the training summary, the merge proof
(for the terminal, `python -m tools.report`, and for the MLflow run's description)."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.atomic import read_json
from pipeline.evaluation.results import PREFERENCE_KEY, TASKS_KEY, VARIANT_KEY, set_figures


def _number(value, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else "-" if value is None else str(value)


def evaluation_table(evaluation: dict) -> list[str]:
    """Set x model: bits per byte, perplexity, tokens; then task x model: each metric with its standard error
    (eval.json keeps the task scores under "tasks": {task: {model: {metric, metric_stderr, samples}}}) and the
    adapter's variant."""
    lines = [f"{'set':<16}{'model':<9}{'bits/byte':>11}{'perplexity':>12}{'tokens':>9}{'accuracy':>16}"]
    for name, models in set_figures(evaluation).items():
        for model, figures in models.items():
            lines.append(
                f"{name[:15]:<16}{model[:8]:<9}{_number(figures.get('bits_per_byte')):>11}"
                f"{_number(figures.get('perplexity'), 2):>12}{_number(figures.get('tokens')):>9}{'-':>16}"
            )
    for task, models in evaluation.get(TASKS_KEY, {}).items():
        for model, figures in models.items():
            for metric, value in figures.items():
                if metric == "samples" or metric.endswith("_stderr"):
                    continue
                error = figures.get(f"{metric}_stderr")
                shown = f"{value:.3f}" + ("" if error is None else f" ± {error:.3f}")
                label = f"{task} {metric}"
                lines.append(f"{label[:15]:<16}{model[:8]:<9}{'-':>11}{'-':>12}{'-':>9}{shown:>16}")
    for name, models in evaluation.get(PREFERENCE_KEY, {}).items():
        for model, figures in models.items():
            shown = f"{figures['preference_accuracy']:.3f}"
            label = f"{name} pairs"
            lines.append(f"{label[:15]:<16}{model[:8]:<9}{'-':>11}{'-':>12}{figures['pairs']:>9}{shown:>16}")
    if VARIANT_KEY in evaluation:
        lines.append(f"adapter: {evaluation[VARIANT_KEY]['name']}")
    return lines


def training_summary(train: dict) -> list[str]:
    steps = f"{train.get('steps')} steps ({train.get('world_size')} rank(s), ZeRO-{train.get('zero_stage')}, "
    steps += f"{train.get('precision')})"
    lines = [
        f"training: {steps}, loss {_number(train.get('final_train_loss'))}, "
        f"validation {_number(train.get('val_loss'))}",
        f"  {_number(train.get('tokens_per_s'), 1)} tokens/s, {_number(train.get('train_seconds'), 1)} s of steps, "
        f"peak {_number(train.get('peak_memory_mb'), 0)} MB per rank",
    ]
    if train.get("reused_checkpoint"):
        lines.append(f"  figures of the run that trained {train['reused_checkpoint']} (this run found it final)")
    return lines


def merge_proof(merge: dict) -> list[str]:
    if "max_abs_logit_diff" not in merge:
        return ["merge: not verified (merge.verify=false)"]
    return [
        f"merge proof: max |logit diff| {merge['max_abs_logit_diff']:.2e} (limit {merge['limit_abs']:.1e}), "
        f"mean KL {merge['mean_kl']:.1e} (limit {merge['limit_kl']:.1e})",
        f"  on {merge['tokens']} tokens",
    ]


def run_description(
    *,
    model: str,
    train_file: str,
    data_format: str,
    lora_r: int,
    max_steps: int,
    commit: str,
    experiment: str | None,
    metrics: dict[str, Path],
) -> str:
    """What the run is and whether it is good, for the top of its MLflow page (Markdown); `metrics` by prefix."""
    lines = [
        f"**LoRA fine-tuning** of `{model}` on `{train_file}` ({data_format}), "
        f"LoRA r={lora_r}, {max_steps} steps; git commit `{commit[:12]}`"
        + (f", DVC experiment `{experiment}`" if experiment else ""),
        "",
    ]
    if metrics.get("eval") and metrics["eval"].is_file():
        lines += ["```", *evaluation_table(read_json(metrics["eval"])), "```", ""]
    if metrics.get("train") and metrics["train"].is_file():
        lines += [*training_summary(read_json(metrics["train"])), ""]
    if metrics.get("merge") and metrics["merge"].is_file():
        lines += [*merge_proof(read_json(metrics["merge"])), ""]
    again = f"dvc exp apply {experiment} && dvc repro" if experiment else "dvc repro"
    lines.append(f"Reproduce: `git checkout {commit[:12]} && {again}` (stages: `dvc dag`).")
    return "\n".join(lines)
