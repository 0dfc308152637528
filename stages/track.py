"""Stage track (the last one): complete the pipeline execution's MLflow run from the pipeline's files, whichever
stages ran and whichever DVC restored from its cache: the flat config, every stage's metrics and the training curve
where the run lacks them, DVC stage hashes, runtime tags, and as artifacts the config, dvc.lock, the adapter, the
evaluation report, the samples and PNG plots; optionally a Model Registry version of the merged model. When MLflow
was unreachable, `dvc repro -f track` logs the pipeline later."""

import argparse
import csv
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from pipeline import config, plots
from pipeline.atomic import read_json
from pipeline.tracking import numeric_leaves, runtime_tags
from stages._common import announce, pipeline_run, run, stage_name

CURVE_KEYS = ("loss", "lr", "val_loss", "val_perplexity")


def stage_tags(lock: dict, logged_tags: dict[str, str], current: str) -> dict[str, str]:
    """`dvc.stage.NAME`: md5 of the stage's dvc.lock entry; `stage.NAME=cached` where it did not run this time.
    The `current` stage's entry is the previous execution's (DVC writes it after the stage): left out."""
    tags = {}
    for name, entry in lock.get("stages", {}).items():
        if name == current:
            continue
        key = name.replace("@", ".")  # eval_set@NAME: MLflow keys take no "@"
        tags[f"dvc.stage.{key}"] = hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()
        logs = "--run-id-file" in entry.get("cmd", "")  # check and eval_set@NAME log nothing of their own
        if logs and logged_tags.get(f"stage.{key}") != "ran":
            tags[f"stage.{key}"] = "cached"
    return tags


def variant_tags(adapter_dir: Path) -> dict[str, str]:
    """What produced the adapter, from its variant.json (else its config): `variant` in words, and `variant.dora`,
    `variant.lr_ratio`, `variant.quantization` (compute dtype with nf4) to filter runs by; none without an adapter."""
    from pipeline.checkpoints import adapter

    if not (adapter_dir / adapter.CONFIG).is_file():
        return {}
    variant = adapter.read_variant(adapter_dir)
    tags = {
        "variant": adapter.describe_variant(variant),
        "variant.dora": str(bool(variant.get("use_dora"))).lower(),
        "variant.lr_ratio": "unknown" if variant.get("quantization") is None else str(variant.get("lr_ratio")),
        "variant.quantization": variant.get("quantization") or "unknown",
    }
    if variant.get("compute_dtype"):
        tags["variant.compute_dtype"] = variant["compute_dtype"]
    return tags


def missing_curve(curve_csv: Path, logged_steps: Callable[[str], set[int]]) -> dict[str, dict[int, float]]:
    """The training curve's values at the steps the run lacks (train was cached, or resumed in an earlier run)."""
    with open(curve_csv, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    series = {}
    for key in CURVE_KEYS:
        have = logged_steps(key)
        values = {int(r["step"]): float(r[key]) for r in rows if r.get(key) and int(r["step"]) not in have}
        if values:
            series[key] = values
    return series


def description(cfg: config.Config, args: argparse.Namespace, tags: dict[str, str]) -> str:
    """What the run is and whether it is good, for the top of its MLflow page (Markdown)."""
    from pipeline.report import evaluation_table, merge_proof, training_summary

    experiment = os.environ.get("DVC_EXP_NAME")
    commit = tags.get("git_commit", "(no git)")
    lines = [
        f"**LoRA fine-tuning** of `{cfg.model.path}` on `{cfg.data.train_file}` ({cfg.data.format}), "
        f"LoRA r={cfg.lora.r}, {cfg.train.max_steps} steps; git commit `{commit[:12]}`"
        + (f", DVC experiment `{experiment}`" if experiment else ""),
        "",
    ]
    metrics = dict(args.metrics)
    if metrics.get("eval") and metrics["eval"].is_file():
        lines += ["```", *evaluation_table(read_json(metrics["eval"])), "```", ""]
    if metrics.get("train") and metrics["train"].is_file():
        lines += [*training_summary(read_json(metrics["train"])), ""]
    if metrics.get("merge") and metrics["merge"].is_file():
        lines += [*merge_proof(read_json(metrics["merge"])), ""]
    again = f"dvc exp apply {experiment} && dvc repro" if experiment else "dvc repro"
    lines.append(f"Reproduce: `git checkout {commit[:12]} && {again}` (stages: `dvc dag`).")
    return "\n".join(lines)


def datasets(cfg: config.Config, lock: dict) -> list[dict[str, str]]:
    """The training data and every evaluation set as MLflow dataset inputs, each digest the DVC hash of what the
    pipeline made of it (the cached dataset, the copied set)."""

    def digest(stage: str) -> str:
        outs = lock.get("stages", {}).get(stage, {}).get("outs", [])
        return outs[0]["md5"] if outs else "unknown"

    found = [{"name": "training data", "digest": digest("cache_dataset"), "source": cfg.data.train_file,
              "context": "training"}]  # fmt: skip
    found += [
        {"name": f"eval set {name}", "digest": digest(f"eval_set@{name}"), "source": path, "context": "evaluation"}
        for name, path in cfg.eval.sets.items()
    ]
    return found


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    with pipeline_run(cfg, args.run_id_file) as tracker:
        if tracker.disabled:
            if tracker.missing:
                print(
                    f"tracking: this pipeline run is not in MLflow ({tracker.missing}); once the store is reachable, "
                    "`dvc repro -f track` logs it from the pipeline's files",
                    file=sys.stderr,
                )
            return
        logged_metrics, logged_tags = tracker.logged()
        lock = yaml.safe_load(args.lock.read_text(encoding="utf-8")) if args.lock.is_file() else {}
        tags = {**stage_tags(lock, logged_tags, stage_name()), **variant_tags(args.adapter)}
        announce(tracker, args.params, tags)
        tracker.set_tags({"mlflow.source.name": "dvc.yaml", "mlflow.source.type": "PROJECT"})
        tracker.describe(description(cfg, args, {**logged_tags, **runtime_tags()}))
        tracker.log_datasets(datasets(cfg, lock))
        figures: dict[str, float] = {}
        for prefix, path in args.metrics:
            if path.is_file():
                figures.update(numeric_leaves(read_json(path), f"{prefix}."))
        tracker.log_metrics({k: v for k, v in figures.items() if k not in logged_metrics})
        if args.curve.is_file():
            tracker.log_series(missing_curve(args.curve, tracker.logged_steps))
        for path, folder in ((Path(args.params), "config"), (args.lock, "config"), (args.adapter, "adapter")):
            if path.exists():
                tracker.log_artifact(path, folder)
        for path in (args.eval_table, args.task_table, args.samples, *(p for _, p in args.metrics)):
            if path.is_file():
                tracker.log_artifact(path, "metrics")
        with tempfile.TemporaryDirectory() as tmp:
            if args.curve.is_file():
                plots.training_curve(args.curve, Path(tmp) / "train_curve.png")
            if args.eval_table.is_file():
                plots.bits_per_byte(args.eval_table, Path(tmp) / "eval_bits_per_byte.png")
            if args.task_table.is_file() and args.task_table.read_text(encoding="utf-8").count("\n") > 1:
                plots.task_scores(args.task_table, Path(tmp) / "eval_tasks.png")
            tracker.log_artifact(Path(tmp), "plots")
        registered = ""
        if cfg.tracking.register_model and args.merged.is_dir():
            tracker.log_artifact(args.merged, "merged")
            version = tracker.register_model(cfg.tracking.register_model, "merged")
            registered = f"; merged model registered as {cfg.tracking.register_model} version {version}"
        if not tracker.disabled:
            ran = sorted({k.removeprefix("stage.") for k, v in logged_tags.items() if v == "ran"} | {stage_name()})
            print(
                f"track: MLflow run {tracker.run_id} on {cfg.tracking.uri} (stages run: {', '.join(ran)}){registered}"
            )


def metrics_file(text: str) -> tuple[str, Path]:
    prefix, sep, path = text.partition("=")
    if not sep or not prefix or not path:
        raise argparse.ArgumentTypeError(f"expected PREFIX=PATH, got {text!r}")
    return prefix, Path(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lock", type=Path, required=True, help="dvc.lock (stage hashes; logged as an artifact)")
    parser.add_argument(
        "--metrics", type=metrics_file, nargs="+", required=True, help="PREFIX=PATH: a stage's metrics JSON"
    )
    parser.add_argument("--curve", type=Path, required=True, help="training curve CSV")
    parser.add_argument("--eval-table", type=Path, required=True, help="bits per byte CSV")
    parser.add_argument("--task-table", type=Path, required=True, help="task accuracy CSV")
    parser.add_argument("--samples", type=Path, required=True, help="greedy samples (Markdown)")
    parser.add_argument("--adapter", type=Path, required=True, help="consolidated adapter folder")
    parser.add_argument("--merged", type=Path, required=True, help="merged model folder (registered on request)")
    parser.add_argument("--run-id-file", type=Path, required=True, help="the pipeline's MLflow run id (JSON)")
    run(main, parser)
