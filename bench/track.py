"""track against what users write today: a script with MLflow's fluent API (`mlflow.start_run`, `log_params`,
`log_metrics` per metrics file, `log_metric` per curve point, `log_artifact(s)`, `log_figure` for two plots)
logging the same pipeline files, each into a new SQLite store, in one run: wall time and peak memory ratios.
Needs `make run` first."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import report, run_measured, side_by_side

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


def reference(uri: str) -> None:
    """The hand-written logging script."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    from pipeline.tracking.mlflow_run import flatten, numeric_leaves

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("llm-lora")
    with mlflow.start_run():
        mlflow.log_params(flatten(yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))))
        for prefix, path in METRICS.items():
            mlflow.log_metrics(numeric_leaves(json.loads(Path(path).read_text(encoding="utf-8")), f"{prefix}."))
        with open("metrics/train_curve.csv", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        for row in rows:
            for key in ("loss", "lr", "val_loss", "val_perplexity"):
                if row[key]:
                    mlflow.log_metric(key, float(row[key]), step=int(row["step"]))
        for path in ("params.yaml", "dvc.lock"):
            mlflow.log_artifact(path, "config")
        mlflow.log_artifacts("artifacts/adapter", "adapter")
        for path in (*METRICS.values(), "metrics/eval_bits_per_byte.csv", "metrics/eval_samples.md"):
            mlflow.log_artifact(path, "metrics")
        figure, axis = plt.subplots()
        axis.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
        mlflow.log_figure(figure, "plots/train_curve.png")
        with open("metrics/eval_bits_per_byte.csv", encoding="utf-8") as handle:
            table = list(csv.DictReader(handle))
        figure, axis = plt.subplots()
        axis.barh([f"{r['set']}/{r['model']}" for r in table], [float(r["bits_per_byte"]) for r in table])
        mlflow.log_figure(figure, "plots/eval_bits_per_byte.png")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
        params["tracking"]["uri"] = f"sqlite:///{work / 'ours.db'}"
        (work / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
        ours = [
            sys.executable, "-m", "stages.track", "--params", str(work / "params.yaml"), "--lock", "dvc.lock",
            "--metrics", *(f"{k}={v}" for k, v in METRICS.items()), "--curve", "metrics/train_curve.csv",
            "--eval-table", "metrics/eval_bits_per_byte.csv", "--task-table", "metrics/eval_tasks.csv",
            "--samples", "metrics/eval_samples.md",
            "--adapter", "artifacts/adapter", "--merged", "artifacts/merged", "--run-id-file", str(work / "run.json"),
        ]  # fmt: skip
        seconds_ours, peak_ours, _ = run_measured(ours)
        hand = [sys.executable, "-m", "bench.track", "reference", f"sqlite:///{work / 'reference.db'}"]
        seconds_reference, peak_reference, _ = run_measured(hand)
    report(
        "track",
        side_by_side(
            reference_seconds=seconds_reference,
            ours_seconds=seconds_ours,
            reference_mb=peak_reference,
            ours_mb=peak_ours,
        ),
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["reference"]:
        reference(sys.argv[2])
    else:
        main()
