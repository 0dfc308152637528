"""track against what users write today: a script with MLflow's fluent API (`mlflow.start_run`, `log_params`,
`log_metrics` per metrics file, `log_metric` per curve point, `log_artifact(s)`, `log_figure` for two plots)
logging the same pipeline files, each into a new SQLite store, in one run: wall time and peak memory ratios.
Needs `make run` first.

    python -m bench.track
    python -m bench.track --smoke [--results DIR]   # the tiny pipeline's files (make test)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import report, results_folder, run_measured, side_by_side, smoke_arguments, smoke_project

METRICS = {
    "base": "metrics/base.json",
    "corpus": "metrics/corpus.json",
    "tokenizer": "metrics/tokenizer.json",
    "dataset": "metrics/dataset.json",
    "train": "metrics/train.json",
    "consolidate": "metrics/consolidate.json",
    "merge": "metrics/merge.json",
    "eval": "metrics/eval.json",
}


def reference(uri: str, root: Path) -> None:
    """The hand-written logging script, over the pipeline files of the project `root`."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    from pipeline.tracking.mlflow_run import flatten, numeric_leaves

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("llm-lora")
    with mlflow.start_run():
        mlflow.log_params(flatten(yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))))
        for prefix, path in METRICS.items():
            mlflow.log_metrics(numeric_leaves(json.loads((root / path).read_text(encoding="utf-8")), f"{prefix}."))
        with open(root / "metrics/train_curve.csv", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        for row in rows:
            for key in ("loss", "lr", "val_loss", "val_perplexity"):
                if row[key]:
                    mlflow.log_metric(key, float(row[key]), step=int(row["step"]))
        for path in ("params.yaml", "dvc.lock"):
            mlflow.log_artifact(str(root / path), "config")
        mlflow.log_artifacts(str(root / "artifacts/adapter"), "adapter")
        for path in (*METRICS.values(), "metrics/eval_bits_per_byte.csv", "metrics/eval_samples.md"):
            mlflow.log_artifact(str(root / path), "metrics")
        figure, axis = plt.subplots()
        axis.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
        mlflow.log_figure(figure, "plots/train_curve.png")
        with open(root / "metrics/eval_bits_per_byte.csv", encoding="utf-8") as handle:
            table = list(csv.DictReader(handle))
        figure, axis = plt.subplots()
        axis.barh([f"{r['set']}/{r['model']}" for r in table], [float(r["bits_per_byte"]) for r in table])
        mlflow.log_figure(figure, "plots/eval_bits_per_byte.png")


def measure(root: Path) -> dict:
    """Both sides logging the pipeline files of the project `root`, each into a new store, in measured processes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
        params["tracking"]["uri"] = f"sqlite:///{work / 'ours.db'}"
        (work / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
        ours = [
            sys.executable, "-m", "stages.track", "--params", str(work / "params.yaml"),
            "--lock", str(root / "dvc.lock"), "--metrics", *(f"{k}={root / v}" for k, v in METRICS.items()),
            "--curve", str(root / "metrics/train_curve.csv"),
            "--eval-table", str(root / "metrics/eval_bits_per_byte.csv"),
            "--task-table", str(root / "metrics/eval_tasks.csv"), "--samples", str(root / "metrics/eval_samples.md"),
            "--adapter", str(root / "artifacts/adapter"), "--merged", str(root / "artifacts/merged"),
            "--run-id-file", str(work / "run.json"),
        ]  # fmt: skip
        seconds_ours, peak_ours, _ = run_measured(ours)
        store = f"sqlite:///{work / 'reference.db'}"
        hand = [sys.executable, "-m", "bench.track", "reference", store, str(root.resolve()), str(work)]
        seconds_reference, peak_reference, _ = run_measured(hand)
    return side_by_side(
        reference_seconds=seconds_reference, ours_seconds=seconds_ours, reference_mb=peak_reference, ours_mb=peak_ours
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("track", measure(Path(".")), results)
        return
    with smoke_project(args.project) as project:
        report("track", {**measure(project), "smoke": True}, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reference"]:
        os.chdir(sys.argv[4])  # the fluent API's default artifact folder (./mlruns) goes beside its store, as ours do
        reference(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
