"""Stage track (the last one): complete the pipeline execution's MLflow run from the pipeline's files, whichever
stages ran and whichever DVC restored from its cache: the flat config, every stage's metrics and the training curve
where the run lacks them, DVC stage hashes, runtime tags, and as artifacts the config, dvc.lock, the adapter, the
evaluation report, the samples and PNG plots; optionally a Model Registry version of the merged model. When MLflow
was unreachable, `dvc repro -f track` logs the pipeline later."""

import argparse
import os
from pathlib import Path

from pipeline.checkpoints.adapter import variant_tags
from pipeline.core import config
from pipeline.core.log import logger
from pipeline.evaluation.report import run_description
from pipeline.tracking import completion, runs_view
from stages._common import announce, pipeline_run, run, stage_name


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    with pipeline_run(cfg, args.run_id_file) as tracker:
        if tracker.disabled:
            if tracker.missing:
                logger("tracking").warning(
                    f"this pipeline run is not in MLflow ({tracker.missing}); once the store is reachable, "
                    "`dvc repro -f track` logs it from the pipeline's files",
                )
            return
        logged_metrics, logged_tags = tracker.logged()
        lock = completion.read_lock(args.lock)
        tags = {**completion.stage_tags(lock, logged_tags, stage_name()), **variant_tags(args.adapter)}
        announce(tracker, args.params, tags)
        tracker.set_tags(completion.SOURCE_TAGS)
        description = run_description(
            model=cfg.model.path,
            train_file=cfg.data.train_file,
            data_format=cfg.data.format,
            lora_r=cfg.lora.r,
            max_steps=cfg.train.max_steps,
            commit=completion.git_commit(logged_tags),
            experiment=os.environ.get("DVC_EXP_NAME"),
            metrics=dict(args.metrics),
        )
        tracker.describe(description)
        headline = runs_view.view_tag(
            metrics=runs_view.headline_metrics(cfg.eval.sets), params=[*runs_view.PARAMS, *runs_view.swept_keys()]
        )
        tracker.tag_experiment({runs_view.VIEW_TAG: headline})
        tracker.log_datasets(completion.datasets(lock, train_file=cfg.data.train_file, eval_sets=cfg.eval.sets))
        files = completion.PipelineFiles(
            params=Path(args.params),
            lock=args.lock,
            metrics=args.metrics,
            curve=args.curve,
            eval_table=args.eval_table,
            task_table=args.task_table,
            samples=args.samples,
            adapter=args.adapter,
        )
        completion.log_files(tracker, files, logged_metrics)
        registered = completion.register(tracker, name=cfg.tracking.register_model, merged=args.merged)
        if not tracker.disabled:
            ran = ", ".join(completion.stages_run(logged_tags, stage_name()))
            logger("track").info(f"MLflow run {tracker.run_id} on {cfg.tracking.uri} (stages run: {ran}){registered}")


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
