"""Stage evaluate: bits per byte and perplexity of the base, base + adapter and merged models on every eval set (text
documents whole; instruction rows and preference pairs on their (chosen) responses), greedy samples from fixed
prompts, the accuracy of each on the lm-evaluation-harness tasks of eval.tasks and on the held-out pairs of the eval
sets that hold pairs and of eval.preference_sets; the table and eval.json name the adapter's variant (DoRA, LoRA+,
QLoRA)."""

import argparse
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import write_json
from pipeline.core.log import logger
from pipeline.data import eval_sets
from pipeline.data.formats import template_for
from pipeline.data.inputs import resolved_format
from pipeline.evaluation import comparison, tasks
from pipeline.evaluation.results import PREFERENCE_KEY, TASKS_KEY, VARIANT_KEY
from stages._common import run

log = logger("eval")


def hides_unused(cfg: config.Config) -> bool:
    """No quantized base and no task: transformers would import scipy (about 1 s of CPU) for its object-detection
    losses; tasks' metrics may need it (through scikit-learn)."""
    return cfg.lora.quantization == "none" and not cfg.eval.tasks


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    e, d = cfg.eval, cfg.data
    specs = tasks.load_tasks(e.tasks, e.task_code)  # checked before any model is loaded
    sets = {name: eval_sets.read_set(args.sets / name) for name in e.sets}
    data_format = resolved_format(d.format, d.train_file, [s.format for s in d.sources])
    scoring = comparison.Scoring(
        template=template_for(data_format, d.prompt_template),
        max_bytes=e.max_bytes,
        context=e.context,
        stride=e.stride,
        batch_size=e.batch_size,
        prompts=e.prompts,
        max_new_tokens=e.max_new_tokens,
        precision=e.precision,
        task_limit=e.task_limit,
        max_seq_len=cfg.data.max_seq_len,
    )
    results, task_results, samples, preferences = comparison.compare(
        base=args.base,
        base_tokenizer=args.base_tokenizer,
        adapter=args.adapter,
        merged=args.merged,
        sets=sets,
        specs=specs,
        scoring=scoring,
        preference_sets={name: Path(path) for name, path in e.preference_sets.items()},
    )
    variant = comparison.adapter_variant(args.adapter)
    comparison.write_tables(
        plot=args.plot,
        task_plot=args.task_plot,
        samples_file=args.samples,
        prompts=e.prompts,
        results=results,
        task_results=task_results,
        samples=samples,
        variant=variant["name"],
    )
    figures = {**results, TASKS_KEY: task_results} if specs else dict(results)
    if preferences:
        figures[PREFERENCE_KEY] = preferences
    write_json(args.metrics, {**figures, VARIANT_KEY: variant})
    log.info(f"the adapter is {variant['name']}")
    print("\n".join(comparison.summary(results, task_results, preferences)))
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
    run(main, parser, prefix="eval", hides_unused=hides_unused)
