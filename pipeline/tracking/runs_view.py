"""What the MLflow UI shows first: the experiment filed as model development (MLflow 3 otherwise opens on its GenAI
overview), each run named after its DVC experiment or sweep point, and a saved view of the runs table ("Views" in
the UI) whose first columns are the headline figures and the keys that tell the runs apart."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable

# MLflow 3's UI files an experiment by its kind; model training, not GenAI apps (which open on traces).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
VIEW = "headline"  # the saved view's share key: #/experiments/ID/runs?viewStateShareKey=headline
VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"  # where MLflow's UI keeps a saved view of the runs table
RUN_NAME_ENV = "PIPELINE_RUN_NAME"  # set by a sweep: its point (`lora.r=8 train.lr=0.0003`) names the job's run
SWEPT_KEYS_ENV = "PIPELINE_SWEPT_KEYS"  # set by a sweep: the keys it varies, shown beside the headline figures
TRAIN_FIGURES = ("train.final_train_loss", "train.val_loss", "train.tokens_per_s", "train.peak_memory_mb")
PARAMS = ("lora.r", "train.lr", "train.max_steps")


def run_name() -> str | None:
    """A new run's name: the sweep's point, else the DVC experiment (`dvc exp run`, queued or not), else `dvc repro`
    and the commit it ran on (None outside a git checkout: MLflow then picks one)."""
    for env in (RUN_NAME_ENV, "DVC_EXP_NAME"):
        if os.environ.get(env):
            return os.environ[env]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"repro {commit.stdout.strip()}" if commit.returncode == 0 else None


def headline_metrics(eval_sets: Iterable[str]) -> list[str]:
    """The figures a run is judged by, as the track stage logs them: each eval set's bits per byte (adapter, then
    base), then the training's."""
    figures = [f"eval.{name}.{model}.bits_per_byte" for name in eval_sets for model in ("adapter", "base")]
    return [*figures, *TRAIN_FIGURES]


def view_tag(*, metrics: Iterable[str], params: Iterable[str], now_ms: int | None = None) -> str:
    """The saved view's experiment tag value: its name, and the runs table's state (columns in this order: the
    metrics, then the params; newest run first) as MLflow's UI writes it."""
    columns = [*(f"metrics.`{m}`" for m in metrics), *(f"params.`{p}`" for p in dict.fromkeys(params))]
    state = {"selectedColumns": columns, "columnOrder": columns, "orderByKey": "attributes.start_time",
             "orderByAsc": False}  # fmt: skip
    created = now_ms if now_ms is not None else int(time.time() * 1000)
    return json.dumps({"name": "Headline figures", "createdAt": created, "state": json.dumps(state)})


def swept_keys() -> list[str]:
    """The keys the sweep running this pipeline varies (none outside a sweep)."""
    return [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]


def runs_url(base: str, experiment_id: str) -> str:
    """The runs table of an experiment in the saved view, in the UI's model-training mode."""
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW}"
