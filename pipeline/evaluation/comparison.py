"""The base, base + adapter and merged models side by side: figures on every set, greedy samples, task scores."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.atomic import atomic_path, read_json
from pipeline.data.eval_sets import EvalSet
from pipeline.evaluation import preference, tasks


@dataclass(frozen=True)
class Scoring:
    """How every model is scored: the sets' prompt template and byte cap, the window, samples and task limit."""

    template: str
    max_bytes: int | None
    context: int
    stride: int
    batch_size: int
    prompts: list[str]
    max_new_tokens: int
    precision: str
    task_limit: int | None
    max_seq_len: int  # preference pairs are cut as training cuts them


def adapter_variant(adapter_dir: Path) -> dict[str, str]:
    """What produced the adapter, as strings: `name` ("DoRA + LoRA+ x16 on an nf4 base (bf16 compute)") and the
    base's `quantization` (none | nf4 | int8 | unknown for an adapter trained elsewhere)."""
    from pipeline.checkpoints import adapter

    variant = adapter.read_variant(adapter_dir)
    return {"name": adapter.describe_variant(variant), "quantization": variant.get("quantization") or "unknown"}


def proven(merged: Path) -> str | None:
    """Why scoring base + adapter again is unnecessary: the merge proof that passed (None: it did not run)."""
    report = merged / "merge_report.json"
    gap = read_json(report).get("verification") if report.is_file() else None
    if not gap or gap["max_abs_logit_diff"] > gap["limit_abs"] or gap["mean_kl"] > gap["limit_kl"]:
        return None
    return f"merged (the merge proof passed: max |logit diff| {gap['max_abs_logit_diff']:.2g})"


def pair_sets(
    sets: dict[str, EvalSet], preference_sets: dict[str, Path], max_bytes: int | None
) -> dict[str, tuple[Path, str, int | None]]:
    """The sets scored as preference pairs, each with its config key and byte limit: those of eval.sets that hold
    pairs (within eval.max_bytes, as their bits per byte) and every pair of eval.preference_sets."""
    found = {
        name: (s.path, f"eval.sets.{name}", max_bytes) for name, s in sets.items() if s.data_format == "preference"
    }
    return {**found, **{name: (path, f"eval.preference_sets.{name}", None) for name, path in preference_sets.items()}}


def score_model(
    *,
    name: str,
    folder: Path,
    adapter: Path | None,
    tokenizer_dir: Path,
    sets: dict[str, EvalSet],
    specs: list[tasks.TaskSpec],
    scoring: Scoring,
    preference_sets: dict[str, Path],
) -> tuple[dict[str, dict], list[str], dict[str, dict], dict]:
    """One model's figures on every set, its greedy samples, its task scores and its log-probabilities of every
    preference set's responses (`preference.pair_logps`)."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluation import likelihood as ev

    s = scoring
    tokenizer = load_tokenizer(tokenizer_dir)
    examples = {
        set_name: ev.load_examples(
            tokenizer,
            found.path,
            data_format=found.data_format,
            template=s.template,
            max_bytes=s.max_bytes,
            context=s.context,
            key=f"eval.sets.{set_name}",
        )
        for set_name, found in sets.items()
    }
    preference_pairs = {
        set_name: preference.load_pairs(
            tokenizer, path, template=s.template, max_seq_len=s.max_seq_len, key=key, max_bytes=limit
        )
        for set_name, (path, key, limit) in pair_sets(sets, preference_sets, s.max_bytes).items()
    }
    replicas = ev.load_replicas(folder, adapter, precision=s.precision)
    model = replicas[0]
    ev.check_vocabulary(tokenizer, model, f"{tokenizer_dir} with {folder}")
    figures = {}
    for set_name, scored_examples in examples.items():
        scored = ev.score(
            replicas,
            scored_examples,
            context=s.context,
            stride=s.stride,
            batch_size=s.batch_size,
            desc=f"{name}/{set_name}",
        )
        figures[set_name] = {k: round(v, 6) for k, v in scored.as_dict().items()}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    logps = {
        set_name: preference.pair_logps(model, pairs, batch_size=s.batch_size, pad_id=pad_id or 0)
        for set_name, pairs in preference_pairs.items()
    }
    samples = ev.greedy_samples(model, tokenizer, prompts=s.prompts, max_new_tokens=s.max_new_tokens)
    scores = tasks.run_tasks(model, tokenizer, specs, batch_size=s.batch_size, limit=s.task_limit)
    return figures, samples, scores, logps


def compare(
    *,
    base: Path,
    base_tokenizer: Path,
    adapter: Path,
    merged: Path,
    sets: dict[str, EvalSet],
    specs: list[tasks.TaskSpec],
    scoring: Scoring,
    preference_sets: dict[str, Path],
) -> tuple[dict[str, dict], dict[str, dict], dict[str, list[str]], dict[str, dict]]:
    """Figures per set and model, task scores per task and model, greedy samples per model and preference figures
    per preference set and model, for the base, base + adapter and merged models; where the merge proof passed, base
    + adapter takes the merged model's (marked `scored_as`) instead of being scored again."""
    models = {
        "base": (base, None, base_tokenizer),
        "adapter": (base, adapter, adapter),
        "merged": (merged, None, merged),
    }
    for name, (folder, adapter_dir, _) in models.items():
        for path in (folder, adapter_dir):
            if path is not None and not path.is_dir():
                raise FileNotFoundError(f"{path}: missing model folder for '{name}'")
    same_as_merged = proven(merged)
    results: dict[str, dict] = {s: {} for s in sets}
    task_results: dict[str, dict] = {spec.name: {} for spec in specs}
    samples: dict[str, list[str]] = {}
    logps: dict[str, dict] = {}
    for name, (folder, adapter_dir, tokenizer_dir) in models.items():
        if name == "adapter" and same_as_merged:
            continue
        figures, samples[name], scores, logps[name] = score_model(
            name=name,
            folder=folder,
            adapter=adapter_dir,
            tokenizer_dir=tokenizer_dir,
            sets=sets,
            specs=specs,
            scoring=scoring,
            preference_sets=preference_sets,
        )
        for set_name, values in figures.items():
            results[set_name][name] = values
        for task, values in scores.items():
            task_results[task][name] = values
    if same_as_merged:
        samples["adapter"] = samples["merged"]
        for by_model in results.values():
            by_model["adapter"] = {**by_model["merged"], "scored_as": same_as_merged}
        for by_model in task_results.values():
            by_model["adapter"] = dict(by_model["merged"])  # the same model: the table above says so
        logps["adapter"] = logps["merged"]
    preferences = {
        set_name: {
            name: preference.figures(by_set[set_name], None if name == "base" else logps["base"][set_name])
            for name, by_set in logps.items()
        }
        for set_name in pair_sets(sets, preference_sets, scoring.max_bytes)
    }
    return results, task_results, samples, preferences


def write_tables(
    *,
    plot: Path,
    task_plot: Path,
    samples_file: Path,
    prompts: list[str],
    results: dict[str, dict],
    task_results: dict[str, dict],
    samples: dict[str, list[str]],
    variant: str,
) -> None:
    """The bits-per-byte CSV (one bar per set and model), the task CSV and the greedy samples as Markdown."""
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(["bar", "set", "model", "bits_per_byte", "perplexity", "variant"])
    for set_name, by_model in results.items():
        for m, v in by_model.items():
            writer.writerow(
                [f"{set_name} / {m}", set_name, m, v["bits_per_byte"], v["perplexity"], "" if m == "base" else variant]
            )
    with atomic_path(plot) as tmp:
        tmp.write_text(table.getvalue(), encoding="utf-8")
    with atomic_path(task_plot) as tmp:
        tmp.write_text("\n".join(tasks.table_rows(task_results)) + "\n", encoding="utf-8")
    lines = ["# Greedy samples", ""]
    for i, prompt in enumerate(prompts):
        answers = [f"- **{m}**: {json.dumps(texts[i], ensure_ascii=False)}" for m, texts in samples.items()]
        lines += [f"## {prompt}", "", *answers, ""]
    with atomic_path(samples_file) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")


def summary(results: dict[str, dict], task_results: dict[str, dict], preferences: dict | None = None) -> list[str]:
    """The figures as terminal lines: set x model, then task x model x metric (± its standard error), then
    preference set x model."""
    lines = [f"{'set':<12} {'model':<8} {'bits/byte':>10} {'perplexity':>12} {'tokens':>8}"]
    for s, by in results.items():
        for m, v in by.items():
            note = "  (= merged: proof passed)" if "scored_as" in v else ""
            lines.append(f"{s:<12} {m:<8} {v['bits_per_byte']:>10.4f} {v['perplexity']:>12.3f} {v['tokens']:>8}{note}")
    for task, metric, model, value, stderr in tasks.scores(task_results):
        error = "" if stderr is None else f" ± {stderr:.4f}"
        lines.append(f"{task:<24} {model:<8} {metric:<22} {value:>7.4f}{error}")
    for set_name, by_model in (preferences or {}).items():
        for model, v in by_model.items():
            reward = f", reward accuracy {v['reward_accuracy']:.4f}" if "reward_accuracy" in v else ""
            lines.append(
                f"{set_name:<12} {model:<8} preference accuracy {v['preference_accuracy']:.4f}, mean margin "
                f"{v['mean_margin']:.3f} nats{reward} ({v['pairs']} pairs)"
            )
    return lines
