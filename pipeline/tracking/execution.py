"""Which pipeline execution a process belongs to, and that execution's one MLflow run, joined by every stage and
by global rank 0 of the train stage."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.tracking.mlflow_run import Tracker, open_run
from pipeline.tracking.runs_view import run_name

EXECUTION_ENV = "PIPELINE_EXECUTION"  # set by a stage for its child processes (the DeepSpeed ranks)
PARENT_RUN_ENV = "PIPELINE_MLFLOW_PARENT_RUN_ID"  # set by a sweep: its pipelines' runs become child runs


def execution_id() -> str:
    """The pipeline execution this process belongs to: $PIPELINE_EXECUTION, else the nearest `dvc` ancestor process
    (one `dvc repro`, `dvc exp run` or queued experiment), else the parent process; as pid and start time."""
    if os.environ.get(EXECUTION_ENV):
        return os.environ[EXECUTION_ENV]
    import psutil

    parent = node = psutil.Process().parent()
    while node is not None:
        try:
            argv = node.cmdline()
        except psutil.Error:
            break
        if any(Path(arg).name == "dvc" for arg in argv[:3]):
            return f"dvc-{node.pid}-{node.create_time():.3f}"
        node = node.parent()
    return f"process-{parent.pid}-{parent.create_time():.3f}" if parent else f"process-{os.getpid()}"


def workspace() -> Path:
    """The main workspace ($DVC_ROOT, also for experiments DVC runs in a copy), else the current folder."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd())


def hand_down() -> str:
    """This process's pipeline execution, named for the processes it starts ($PIPELINE_EXECUTION): they join its
    run, whichever of them opens it first."""
    os.environ[EXECUTION_ENV] = execution = execution_id()
    return execution


def pipeline_run(*, uri: str, experiment: str, run_id_file: Path) -> Tracker:
    """Open (or join) the MLflow run of this pipeline execution, a new one named after its DVC experiment or sweep
    point; child processes started afterwards join it too. A relative SQLite store lives in the main workspace."""
    return open_run(
        uri=uri,
        experiment=experiment,
        run_id_file=run_id_file,
        execution=hand_down(),
        run_name=run_name(),
        parent_run_id=os.environ.get(PARENT_RUN_ENV),
        root=workspace(),
    )
