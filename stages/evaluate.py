"""Stage evaluate: bits per byte and perplexity of the base, base + adapter and merged models on every eval set,
greedy samples from fixed prompts, and the accuracy of each on the lm-evaluation-harness tasks of eval.tasks."""

import argparse
import json
from pathlib import Path

from pipeline import config
from pipeline.atomic import atomic_path, write_json
from stages._common import run


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    from pipeline import evaluate as ev
    from pipeline import tasks
    from pipeline.tokenizer import load_tokenizer

    e = cfg.eval
    task_specs = tasks.load_tasks(e.tasks)  # checked before any model is loaded
    task_results: dict[str, dict] = {spec.name: {} for spec in task_specs}
    models = {
        "base": (args.base, None, args.base_tokenizer),
        "adapter": (args.base, args.adapter, args.adapter),
        "merged": (args.merged, None, args.merged),
    }
    for name, (folder, adapter, _) in models.items():
        for path in (folder, adapter):
            if path is not None and not path.is_dir():
                raise FileNotFoundError(f"{path}: missing model folder for '{name}'")
    results: dict[str, dict] = {s: {} for s in e.sets}
    samples: dict[str, list[str]] = {}
    for name, (folder, adapter, tokenizer_dir) in models.items():
        tokenizer = load_tokenizer(tokenizer_dir)
        sets = {
            s: ev.load_examples(
                tokenizer,
                Path(p),
                template=cfg.data.prompt_template,
                max_bytes=e.max_bytes,
                context=e.context,
                key=f"eval.sets.{s}",
            )
            for s, p in e.sets.items()
        }
        model = ev.load_model(folder, adapter, precision=e.precision)
        ev.check_vocabulary(tokenizer, model, f"{tokenizer_dir} with {folder}")
        for set_name, examples in sets.items():
            scored = ev.score(
                model,
                examples,
                context=e.context,
                stride=e.stride,
                batch_size=e.batch_size,
                desc=f"evaluate {name}/{set_name}",
            )
            results[set_name][name] = {k: round(v, 6) for k, v in scored.as_dict().items()}
        samples[name] = ev.greedy_samples(model, tokenizer, prompts=e.prompts, max_new_tokens=e.max_new_tokens)
        for task, figures in tasks.run_tasks(
            model, tokenizer, task_specs, batch_size=e.batch_size, limit=e.task_limit
        ).items():
            task_results[task][name] = figures
        del model
    figures = {**results, config.TASKS_KEY: task_results} if task_specs else results
    write_json(args.metrics, figures)
    with atomic_path(args.task_plot) as tmp:
        tmp.write_text("\n".join(tasks.table_rows(task_results)) + "\n", encoding="utf-8")
    rows = ["set,model,bits_per_byte,perplexity"]
    rows += [f"{s},{m},{v['bits_per_byte']},{v['perplexity']}" for s, by in results.items() for m, v in by.items()]
    with atomic_path(args.plot) as tmp:
        tmp.write_text("\n".join(rows) + "\n", encoding="utf-8")
    lines = ["# Greedy samples", ""]
    for i, prompt in enumerate(e.prompts):
        answers = [f"- **{m}**: {json.dumps(texts[i], ensure_ascii=False)}" for m, texts in samples.items()]
        lines += [f"## {prompt}", "", *answers, ""]
    with atomic_path(args.samples) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    print(f"{'set':<12} {'model':<8} {'bits/byte':>10} {'perplexity':>12} {'tokens':>8} {'bytes':>8}")
    for s, by in results.items():
        for m, v in by.items():
            print(
                f"{s:<12} {m:<8} {v['bits_per_byte']:>10.4f} {v['perplexity']:>12.3f} {v['tokens']:>8} {v['bytes']:>8}"
            )
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
        ("metrics", "eval.json to write"),
        ("plot", "CSV of bits per byte per set and model (a DVC plot)"),
        ("task-plot", "CSV of task accuracy per task, metric and model (a DVC plot)"),
        ("samples", "Markdown file of greedy samples"),
    ):
        parser.add_argument(f"--{name}", type=Path, required=True, help=meaning)
    run(main, parser, prefix="eval")
