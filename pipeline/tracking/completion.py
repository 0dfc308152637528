"""The pipeline execution's MLflow run completed from the pipeline's files, whichever stages ran this time."""

from __future__ import annotations

import csv
import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.core.atomic import read_json
from pipeline.tracking import plots
from pipeline.tracking.mlflow_run import Tracker, numeric_leaves, runtime_tags

CURVE_KEYS = ("loss", "lr", "val_loss", "val_perplexity")
SOURCE_TAGS = {"mlflow.source.name": "dvc.yaml", "mlflow.source.type": "PROJECT"}


@dataclass(frozen=True)
class PipelineFiles:
    """What the pipeline wrote that the run is completed from (any of them may be absent)."""

    params: Path
    lock: Path
    metrics: list[tuple[str, Path]]  # (prefix, a stage's metrics JSON)
    curve: Path
    eval_table: Path
    task_table: Path
    samples: Path
    adapter: Path


def read_lock(path: Path) -> dict:
    """dvc.lock as a dict ({} where there is none yet)."""
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}


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


def git_commit(logged_tags: dict[str, str]) -> str:
    """The commit this process runs at, else the one the run recorded, else "(no git)"."""
    return {**logged_tags, **runtime_tags()}.get("git_commit", "(no git)")


def stages_run(logged_tags: dict[str, str], current: str) -> list[str]:
    """The stages that ran in this execution (tagged `stage.NAME=ran`) and the `current` one, sorted."""
    return sorted({k.removeprefix("stage.") for k, v in logged_tags.items() if v == "ran"} | {current})


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


def datasets(lock: dict, *, train_file: str, eval_sets: dict[str, str]) -> list[dict[str, str]]:
    """The training data and every evaluation set as MLflow dataset inputs, each digest the DVC hash of what the
    pipeline made of it (the cached dataset, the copied set)."""

    def digest(stage: str) -> str:
        outs = lock.get("stages", {}).get(stage, {}).get("outs", [])
        return outs[0]["md5"] if outs else "unknown"

    found = [{"name": "training data", "digest": digest("cache_dataset"), "source": train_file, "context": "training"}]
    found += [
        {"name": f"eval set {name}", "digest": digest(f"eval_set@{name}"), "source": path, "context": "evaluation"}
        for name, path in eval_sets.items()
    ]
    return found


def log_files(tracker: Tracker, files: PipelineFiles, logged_metrics: dict[str, float]) -> None:
    """Every metrics file's numeric figures the run lacks (under its prefix) and the curve's missing steps; as
    artifacts the config, dvc.lock, the adapter, the tables, samples and metrics files, and PNG plots."""
    figures: dict[str, float] = {}
    for prefix, path in files.metrics:
        if path.is_file():
            figures.update(numeric_leaves(read_json(path), f"{prefix}."))
    tracker.log_metrics({k: v for k, v in figures.items() if k not in logged_metrics})
    if files.curve.is_file():
        tracker.log_series(missing_curve(files.curve, tracker.logged_steps))
    for path, folder in ((files.params, "config"), (files.lock, "config"), (files.adapter, "adapter")):
        if path.exists():
            tracker.log_artifact(path, folder)
    for path in (files.eval_table, files.task_table, files.samples, *(p for _, p in files.metrics)):
        if path.is_file():
            tracker.log_artifact(path, "metrics")
    with tempfile.TemporaryDirectory() as tmp:
        if files.curve.is_file():
            plots.training_curve(files.curve, Path(tmp) / "train_curve.png")
        if files.eval_table.is_file():
            plots.bits_per_byte(files.eval_table, Path(tmp) / "eval_bits_per_byte.png")
        if files.task_table.is_file() and files.task_table.read_text(encoding="utf-8").count("\n") > 1:
            plots.task_scores(files.task_table, Path(tmp) / "eval_tasks.png")
        tracker.log_artifact(Path(tmp), "plots")


def register(tracker: Tracker, *, name: str | None, merged: Path) -> str:
    """The merged model logged and registered as `name` (no name or no model: nothing); what was done, in words."""
    if not name or not merged.is_dir():
        return ""
    tracker.log_artifact(merged, "merged")
    version = tracker.register_model(name, "merged")
    return f"; merged model registered as {name} version {version}"
