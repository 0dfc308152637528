"""MLflow tracking against a real SQLite store: run reuse across stages, and never failing the caller."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.core.atomic import read_json
from pipeline.tracking.mlflow_run import (
    HTTP_DEFAULTS,
    MAX_PARAM_VALUE,
    _retry_locked,
    flatten,
    numeric_leaves,
    open_run,
    resolve_uri,
    runtime_tags,
)
from tests.conftest import REPO

URI = "sqlite:///mlruns.db"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite database with its tables created (the migrations take ~2 s; copying it, nothing)."""
    db = tmp_path_factory.mktemp("store") / "mlruns.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_store: Path) -> Path:
    """Run in tmp_path with a fresh store (the URI is relative); undo the HTTP settings open_run puts in os.environ."""
    shutil.copy(empty_store, tmp_path / "mlruns.db")
    monkeypatch.chdir(tmp_path)
    for name in HTTP_DEFAULTS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path


def client() -> MlflowClient:
    return MlflowClient(f"sqlite:///{Path('mlruns.db').resolve()}")


def test_flatten_nested_config():
    config = {
        "seed": 0,
        "lora": {"r": 8, "dropout": 0.05, "use_rslora": False, "target_modules": ["q_proj", "k_proj"]},
        "launcher": {"hostfile": None},
        "eval": {"sets": {"wiki:zh": "a.txt"}, "prompts": []},
        "stages": [{"name": "a"}, {"name": "b"}],
    }
    assert flatten(config) == {
        "seed": "0",
        "lora.r": "8",
        "lora.dropout": "0.05",
        "lora.use_rslora": "false",
        "lora.target_modules": "[q_proj, k_proj]",
        "launcher.hostfile": "null",
        "eval.sets.wiki_zh": "a.txt",  # ':' is not allowed in an MLflow key everywhere
        "eval.prompts": "[]",
        "stages.0.name": "a",
        "stages.1.name": "b",
    }
    long = flatten({"p": ["x" * 5000, "y" * 5000]}, prefix="eval.")["eval.p"]
    assert long == ("[" + "x" * 5000 + ", " + "y" * 5000 + "]")[:MAX_PARAM_VALUE]


def test_numeric_leaves_keep_numbers_only():
    figures = {"in_domain": {"base": {"bits_per_byte": 2.8, "tokens": 9923}}, "precision": "fp32", "mfu": None}
    assert numeric_leaves({**figures, "ok": True}, "eval.") == {
        "eval.in_domain.base.bits_per_byte": 2.8,
        "eval.in_domain.base.tokens": 9923.0,
    }


def test_runtime_tags_versions_and_git(tmp_path: Path):
    assert "version.mlflow" in runtime_tags(tmp_path)
    assert "git_commit" not in runtime_tags(tmp_path)  # not a repository

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    tags = runtime_tags(tmp_path)
    assert (tags["git_commit"], tags["git_dirty"]) == (head, "false")
    (tmp_path / "a.txt").write_text("2")
    assert runtime_tags(tmp_path)["git_dirty"] == "true"


def test_stages_of_one_execution_share_one_run(tmp_path: Path):
    id_file = tmp_path / "out" / "run.json"
    first = open_run(URI, "lora", id_file, execution="exec-1", run_name="smoke")
    assert not first.disabled
    recorded = read_json(id_file)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    assert recorded == {"execution": "exec-1", "run_id": first.run_id, "tracking_uri": uri}
    first.log_params(flatten({"lora": {"r": 8}}))
    first.set_tags({"stage": "train"})
    first.log_metrics({"train/loss": 2.0, "lr": 1e-4}, step=1)
    first.log_metrics({"train/loss": 1.5}, step=2)
    first.close()
    assert client().get_run(first.run_id).info.status == "FINISHED"

    second = open_run(URI, "lora", id_file, execution="exec-1")
    assert second.run_id == first.run_id
    assert client().get_run(second.run_id).info.status == "RUNNING"
    second.log_params({"lora.r": 8, "eval.context": 64})  # an equal value again is accepted
    second.set_tags({"stage": "evaluate"})
    second.log_metrics({"eval/ppl": 7.0})
    second.log_series({"train/loss": {3: 1.2, 4: 1.1}})
    (tmp_path / "report.json").write_text("{}")
    second.log_artifact(tmp_path / "report.json", "eval")
    assert second.logged()[0]["eval/ppl"] == 7.0 and second.logged_steps("train/loss") == {1, 2, 3, 4}
    second.close()
    assert not second.disabled

    run = client().get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "smoke"
    assert run.data.params == {"lora.r": "8", "eval.context": "64"}
    assert run.data.tags["stage"] == "evaluate"
    history = client().get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.0), (2, 1.5), (3, 1.2), (4, 1.1)]
    assert [(m.step, m.value) for m in client().get_metric_history(run.info.run_id, "eval/ppl")] == [(0, 7.0)]
    assert [a.path for a in client().list_artifacts(run.info.run_id, "eval")] == ["eval/report.json"]
    artifact_root = (tmp_path / "mlartifacts").as_uri()
    assert run.info.artifact_uri.startswith(artifact_root), "artifacts go beside the database"


def test_next_execution_gets_a_new_run_and_ends_an_interrupted_one(tmp_path: Path):
    id_file = tmp_path / "run.json"
    interrupted = open_run(
        URI, "lora", id_file, execution="exec-1", parent_run_id="sweep-parent"
    )  # never closed: killed
    following = open_run(URI, "lora", id_file, execution="exec-2")
    assert following.run_id != interrupted.run_id
    assert client().get_run(interrupted.run_id).info.status == "KILLED"
    assert client().get_run(interrupted.run_id).data.tags["mlflow.parentRunId"] == "sweep-parent"
    assert read_json(id_file)["execution"] == "exec-2"
    following.close()


def test_new_run_when_id_file_names_another_uri_experiment_or_a_deleted_run(tmp_path: Path):
    id_file = tmp_path / "run.json"
    first = open_run(URI, "lora", id_file)
    first.close()

    recorded = read_json(id_file)
    id_file.write_text(json.dumps({**recorded, "tracking_uri": "sqlite:////elsewhere/mlruns.db"}))
    other_uri = open_run(URI, "lora", id_file)
    assert other_uri.run_id != first.run_id
    assert read_json(id_file)["run_id"] == other_uri.run_id
    other_uri.close()

    other_experiment = open_run(URI, "lora-sweep", id_file)
    assert other_experiment.run_id not in (first.run_id, other_uri.run_id)
    other_experiment.close()

    client().delete_run(other_experiment.run_id)
    after_delete = open_run(URI, "lora-sweep", id_file)
    assert after_delete.run_id != other_experiment.run_id
    after_delete.close()

    id_file.write_text("not json")
    assert not open_run(URI, "lora", id_file).disabled


def test_relative_store_resolves_against_the_given_root(tmp_path: Path):
    assert resolve_uri("sqlite:///mlruns.db", tmp_path) == f"sqlite:///{tmp_path / 'mlruns.db'}"
    assert resolve_uri("sqlite:////abs/mlruns.db", tmp_path) == "sqlite:////abs/mlruns.db"
    assert resolve_uri("http://host:5000", tmp_path) == "http://host:5000"
    workspace = tmp_path / "workspace"
    tracker = open_run(
        URI, "lora", tmp_path / "run.json", execution="exec-1", root=workspace
    )  # a queued experiment's copy
    assert (workspace / "mlruns.db").is_file() and not tracker.disabled
    tracker.close()


def test_unreachable_server_warns_once_per_execution(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    id_file = tmp_path / "run.json"
    tracker = open_run(UNREACHABLE, "lora", id_file, execution="exec-1")  # HTTP_DEFAULTS: 3 attempts, ~2 s in all
    assert tracker.disabled and tracker.missing == f"MlflowException on {UNREACHABLE}"
    tracker.log_params({"a": 1})
    tracker.set_tags({"b": "c"})
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_artifact(tmp_path / "missing.txt")
    tracker.close("FAILED")
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"tracking: cannot open a run on {UNREACHABLE} (")
    assert "Connection refused" in err and err.endswith("; going on without MLflow\n")
    assert read_json(id_file)["missing"] == tracker.missing, "the execution's run is marked missing"

    later_stage = open_run(UNREACHABLE, "lora", id_file, execution="exec-1")
    assert later_stage.disabled and later_stage.missing == tracker.missing
    assert capfd.readouterr().err == "", "later stages of the execution neither wait nor warn again"

    back = open_run(URI, "lora", id_file, execution="exec-2")
    assert not back.disabled and back.missing is None
    back.close()


def test_user_http_settings_are_kept(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert open_run("http://user:secret@127.0.0.1:9", "lora", Path("run.json")).disabled
    err = capfd.readouterr().err
    assert "http://127.0.0.1:9" in err and "secret" not in err
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]


def test_failing_call_disables_tracking_with_one_warning(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """One warning in the stage, nothing after it reaches the run."""
    tracker = open_run(uri=URI, experiment="lora", run_id_file=tmp_path / "run.json")
    tracker.log_params({"lora.r": 8})
    capfd.readouterr()
    tracker.log_params({"lora.r": 16})  # MLflow refuses to change a logged param
    assert tracker.disabled
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.close()
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("tracking: log_params on sqlite:///"), err
    run = client().get_run(tracker.run_id)
    assert run.data.params == {"lora.r": "8"} and run.data.metrics == {}
    assert run.info.status == "RUNNING"  # nothing reaches MLflow after the failure


def test_context_manager_marks_failed_run():
    with pytest.raises(RuntimeError), open_run(URI, "lora", Path("run.json")) as tracker:
        raise RuntimeError("out of memory")
    assert client().get_run(tracker.run_id).info.status == "FAILED"


def test_empty_uri_is_silently_disabled(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    tracker = open_run("", "lora", tmp_path / "run.json")
    assert tracker.disabled
    tracker.log_params({"a": "b" * (MAX_PARAM_VALUE + 1)})
    tracker.log_metrics({"loss": 1.0})
    tracker.close()
    assert capfd.readouterr().err == ""
    assert not (tmp_path / "run.json").exists()


def test_locked_database_is_retried():
    attempts = []

    def write() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise sqlite3.OperationalError("database is locked")
        return "written"

    assert _retry_locked(write) == "written" and len(attempts) == 3

    def broken() -> None:
        attempts.append(1)
        raise sqlite3.OperationalError("disk I/O error")

    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        _retry_locked(broken)
    assert len(attempts) == 4  # other errors are not retried


WRITER = """
import sys
from pathlib import Path
from pipeline.tracking.mlflow_run import open_run

name, uri = sys.argv[1], sys.argv[2]
tracker = open_run(uri, "lora", Path(name + ".json"), execution=name, run_name=name)
tracker.log_params({f"p{i}": i for i in range(50)})
for step in range(1, 101):
    tracker.log_metrics({"loss": 1.0 / step, "lr": 1e-4}, step=step)
tracker.set_tags({"writer": name})
tracker.close()
assert not tracker.disabled, "a write was lost"
"""


@pytest.mark.slow
def test_two_pipelines_log_to_one_new_store_at_once(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlruns.db'}"  # not created yet: both race to create its tables
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, name, uri], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
        )
        for name in ("left", "right")
    ]
    errors = [w.communicate(timeout=300)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert not any("tracking:" in e for e in errors), errors
    store = MlflowClient(uri)
    runs = store.search_runs([store.get_experiment_by_name("lora").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["left", "right"]
    for run in runs:
        assert len(run.data.params) == 50 and run.data.tags["writer"] == run.info.run_name
        history = store.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, 101)), "no metric lost"
