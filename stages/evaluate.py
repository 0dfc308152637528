"""Stage evaluate: bits per byte and perplexity of the base, base + adapter and merged models on every eval set,
greedy samples from fixed prompts, and the accuracy of each on the lm-evaluation-harness tasks of eval.tasks; the table
and eval.json name the adapter's variant (DoRA, LoRA+, QLoRA)."""

import argparse
import csv
import io
import json
from pathlib import Path

from pipeline import config
from pipeline.atomic import atomic_path, read_json, write_json
from stages._common import run


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


def score_model(cfg: config.Config, args: argparse.Namespace, name: str, folder: Path, adapter, tokenizer_dir, specs):
    """One model's figures on every set, its greedy samples and its task scores."""
    from pipeline import evaluate as ev
    from pipeline import tasks
    from pipeline.tokenizer import load_tokenizer

    e = cfg.eval
    tokenizer = load_tokenizer(tokenizer_dir)
    sets = {
        set_name: ev.load_examples(
            tokenizer,
            args.sets / set_name / Path(path).name,
            template=cfg.data.prompt_template,
            max_bytes=e.max_bytes,
            context=e.context,
            key=f"eval.sets.{set_name}",
        )
        for set_name, path in e.sets.items()
    }
    model = ev.load_model(folder, adapter, precision=e.precision)
    ev.check_vocabulary(tokenizer, model, f"{tokenizer_dir} with {folder}")
    figures = {}
    for set_name, examples in sets.items():
        scored = ev.score(
            model, examples, context=e.context, stride=e.stride, batch_size=e.batch_size, desc=f"{name}/{set_name}"
        )
        figures[set_name] = {k: round(v, 6) for k, v in scored.as_dict().items()}
    samples = ev.greedy_samples(model, tokenizer, prompts=e.prompts, max_new_tokens=e.max_new_tokens)
    return figures, samples, tasks.run_tasks(model, tokenizer, specs, batch_size=e.batch_size, limit=e.task_limit)


def write_outputs(
    args: argparse.Namespace, prompts: list[str], results: dict, task_results: dict, samples: dict, *, variant: str
) -> None:
    from pipeline import tasks

    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(["bar", "set", "model", "bits_per_byte", "perplexity", "variant"])  # one bar per set and model
    for set_name, by_model in results.items():
        for m, v in by_model.items():
            writer.writerow(
                [f"{set_name} / {m}", set_name, m, v["bits_per_byte"], v["perplexity"], "" if m == "base" else variant]
            )
    with atomic_path(args.plot) as tmp:
        tmp.write_text(table.getvalue(), encoding="utf-8")
    with atomic_path(args.task_plot) as tmp:
        tmp.write_text("\n".join(tasks.table_rows(task_results)) + "\n", encoding="utf-8")
    lines = ["# Greedy samples", ""]
    for i, prompt in enumerate(prompts):
        answers = [f"- **{m}**: {json.dumps(texts[i], ensure_ascii=False)}" for m, texts in samples.items()]
        lines += [f"## {prompt}", "", *answers, ""]
    with atomic_path(args.samples) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    from pipeline import tasks

    specs = tasks.load_tasks(cfg.eval.tasks)  # checked before any model is loaded
    models = {
        "base": (args.base, None, args.base_tokenizer),
        "adapter": (args.base, args.adapter, args.adapter),
        "merged": (args.merged, None, args.merged),
    }
    for name, (folder, adapter, _) in models.items():
        for path in (folder, adapter):
            if path is not None and not path.is_dir():
                raise FileNotFoundError(f"{path}: missing model folder for '{name}'")
    same_as_merged = proven(args.merged)
    results: dict[str, dict] = {s: {} for s in cfg.eval.sets}
    task_results: dict[str, dict] = {spec.name: {} for spec in specs}
    samples: dict[str, list[str]] = {}
    for name, (folder, adapter, tokenizer_dir) in models.items():
        if name == "adapter" and same_as_merged:
            continue
        figures, samples[name], scores = score_model(cfg, args, name, folder, adapter, tokenizer_dir, specs)
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
    variant = adapter_variant(args.adapter)
    write_outputs(args, cfg.eval.prompts, results, task_results, samples, variant=variant["name"])
    figures = {**results, config.TASKS_KEY: task_results} if specs else dict(results)
    write_json(args.metrics, {**figures, config.VARIANT_KEY: variant})
    print(f"eval: the adapter is {variant['name']}")
    print(f"{'set':<12} {'model':<8} {'bits/byte':>10} {'perplexity':>12} {'tokens':>8}")
    for s, by in results.items():
        for m, v in by.items():
            note = "  (= merged: proof passed)" if "scored_as" in v else ""
            print(f"{s:<12} {m:<8} {v['bits_per_byte']:>10.4f} {v['perplexity']:>12.3f} {v['tokens']:>8}{note}")
    for task, metric, model, value, stderr in tasks.scores(task_results):
        print(f"{task:<24} {model:<8} {metric:<22} {value:>7.4f}" + ("" if stderr is None else f" ± {stderr:.4f}"))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    for name, meaning in (
        ("base", "prepared base model folder"),
        ("base-tokenizer", "the base's own tokenizer"),
        ("adapter", "consolidated adapter folder (with its tokenizer)"),
        ("merged", "merged model folder"),
        ("sets", "folder of the evaluation sets, one subfolder per name (written by eval_set@NAME)"),
        ("metrics", "eval.json to write"),
        ("plot", "CSV of bits per byte per set and model (a DVC plot)"),
        ("task-plot", "CSV of task accuracy per task, metric and model (a DVC plot)"),
        ("samples", "Markdown file of greedy samples"),
    ):
        parser.add_argument(f"--{name}", type=Path, required=True, help=meaning)
    run(main, parser, prefix="eval")
