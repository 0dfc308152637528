"""What the MLflow UI shows first (pipeline/tracking/runs_view.py): the run's name, the headline view as MLflow's UI
reads a saved view, the experiment filed as model development, and a sweep's point."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mlflow import MlflowClient

from pipeline.tracking import runs_view
from pipeline.tracking.mlflow_run import open_run
from tools.sweep import point, swept


def test_a_run_is_named_after_its_sweep_point_else_its_dvc_experiment_else_its_commit(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "init"], check=True)
    short = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(runs_view.RUN_NAME_ENV, raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert runs_view.run_name() == f"repro {short}"
    monkeypatch.setenv("DVC_EXP_NAME", "kempt-bear")
    assert runs_view.run_name() == "kempt-bear"
    monkeypatch.setenv(runs_view.RUN_NAME_ENV, "lora.r=8 train.lr=0.0003")
    assert runs_view.run_name() == "lora.r=8 train.lr=0.0003"


def test_the_headline_view_is_a_saved_view_as_the_ui_reads_it():
    """MLflow 3.17's UI: an envelope {name, createdAt, state} whose state is the runs table's JSON, columns as
    `metrics.\\`KEY\\`` and `params.\\`KEY\\`` in the order shown."""
    metrics = runs_view.headline_metrics({"in_domain": "a.txt", "en_wiki": "b.txt"})
    assert metrics[:4] == [
        "eval.in_domain.adapter.bits_per_byte", "eval.in_domain.base.bits_per_byte",
        "eval.en_wiki.adapter.bits_per_byte", "eval.en_wiki.base.bits_per_byte",
    ]  # fmt: skip
    envelope = json.loads(runs_view.view_tag(metrics=metrics[:1], params=["lora.r", "train.lr", "lora.r"], now_ms=7))
    assert (envelope["name"], envelope["createdAt"]) == ("Headline figures", 7)
    state = json.loads(envelope["state"])
    assert state["selectedColumns"] == state["columnOrder"] == [
        "metrics.`eval.in_domain.adapter.bits_per_byte`", "params.`lora.r`", "params.`train.lr`"
    ]  # fmt: skip
    assert runs_view.runs_url("http://h:1", "3").endswith("#/experiments/3/runs?workflowType=machine_learning"
                                                          "&viewStateShareKey=headline")  # fmt: skip


def test_the_experiment_is_model_development_and_takes_the_view(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    tracker = open_run(uri, "lora", tmp_path / "run.json", execution="e1", run_name="kempt-bear")
    tracker.tag_experiment({runs_view.VIEW_TAG: "{}"})
    tracker.close()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("lora")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment.tags[runs_view.VIEW_TAG] == "{}"
    assert client.get_run(tracker.run_id).info.run_name == "kempt-bear"


def test_a_sweep_point_holds_the_swept_keys_only():
    overrides = ["experiment=tiny", "lora.r=4,2", "train.lr=interval(1e-4,1e-3)", "+data.x=choice(1,2)", "seed=3"]
    assert swept(overrides) == ["lora.r", "train.lr", "data.x"]
    job = ["experiment=tiny", "lora.r=4", "train.lr=0.0005", "+data.x=1", "seed=3"]
    assert point(job, ["lora.r", "train.lr", "data.x"]) == "lora.r=4 train.lr=0.0005 +data.x=1"
