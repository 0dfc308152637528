"""MLflow tracking for the stages (global rank 0 only): one run shared through a run-id file, never fatal."""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pipeline.atomic import write_json

T = TypeVar("T")

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value, in characters
PACKAGES = ("torch", "deepspeed", "transformers", "peft", "datasets", "mlflow")
# An unreachable server fails in ~2 s (3 attempts, backoff 0 s then 2 s) instead of MLflow's ~4 min default.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
# SQLite "database is locked": MLflow already waits 20 s (busy_timeout) before raising it, but a writer that would
# deadlock gets it at once; those are retried with backoff 0.1, 0.2 ... 2 s while less than this has passed.
LOCK_PATIENCE_S = 10.0
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- ]")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts and lists -> {"lora.r": "8", "lora.target_modules": "[q_proj, k_proj]"} as MLflow params."""
    flat: dict[str, str] = {}
    for name, value in config.items():
        key = f"{prefix}{_BAD_KEY_CHARS.sub('_', str(name))}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{key}."))
        elif isinstance(value, list | tuple) and any(isinstance(v, Mapping | list | tuple) for v in value):
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, f"{key}."))
        else:
            flat[key] = _render(value)[:MAX_PARAM_VALUE]
    return flat


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return str(value)


def runtime_tags(cwd: Path | None = None) -> dict[str, str]:
    """Installed versions of the training stack, and the git commit and dirtiness of `cwd` (tracked files only)."""
    tags = {}
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            tags[f"version.{package}"] = importlib.metadata.version(package)
    commit = _git(["rev-parse", "HEAD"], cwd)
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    if commit and status is not None:
        tags["git_commit"] = commit
        tags["git_dirty"] = "true" if status else "false"
    return tags


def _git(args: list[str], cwd: Path | None) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


class Tracker:
    """One MLflow run, logged through an explicit MlflowClient; after the first failure every call is a no-op."""

    def __init__(self, client: Any = None, run_id: str | None = None, uri: str = "") -> None:
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.closed = False

    @property
    def disabled(self) -> bool:
        """True when tracking is off: no URI, or an MLflow call failed."""
        return self.client is None

    def log_params(self, params: Mapping[str, object]) -> None:
        """Log params (values as strings, truncated to MLflow's limit); re-logging an equal value is fine."""

        def log() -> None:
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()])

        self._call("log_params", log)

    def set_tags(self, tags: Mapping[str, object]) -> None:
        """Set run tags (overwriting earlier values)."""

        def log() -> None:
            from mlflow.entities import RunTag

            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

        self._call("set_tags", log)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log metrics in one batch, at `step` (0 when None)."""

        def log() -> None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
            self.client.log_batch(self.run_id, metrics=items)

        self._call("log_metrics", log)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a folder's contents, under `artifact_path` in the run's artifacts."""

        def upload() -> None:
            local = Path(path)
            if local.is_dir():
                self.client.log_artifacts(self.run_id, str(local), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(local), artifact_path)

        self._call("log_artifact", upload)

    def close(self, status: str = "FINISHED") -> None:
        """End the run with `status` (FINISHED, FAILED or KILLED); later calls are no-ops."""
        if not self.closed:
            self._call("close", lambda: self.client.set_terminated(self.run_id, status=status))
        self.closed = True

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close("FINISHED" if kind is None else "FAILED")

    def _call(self, what: str, action: Callable[[], object]) -> None:
        if self.disabled or self.closed:
            return
        try:
            _retry_locked(action)
        except Exception as err:  # tracking must never stop training
            _warn(f"{what} on {_redact(self.uri)} failed", err)
            self.client = None


def open_run(uri: str, experiment: str, run_id_file: Path, run_name: str | None = None) -> Tracker:
    """Re-open the run named in `run_id_file` (same URI and experiment), else start one and record its id there."""
    if not uri:
        return Tracker()
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    uri = _resolve(uri)
    run_id_file = Path(run_id_file)
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        run_id = _retry_locked(lambda: _reopen(client, uri, experiment, run_id_file))
        if run_id is None:
            run_id = _retry_locked(lambda: _create(client, experiment, run_name))
            write_json(run_id_file, {"run_id": run_id, "tracking_uri": _redact(uri)})
    except Exception as err:  # tracking must never stop training
        _warn(f"cannot open a run on {_redact(uri)}", err)
        return Tracker()
    return Tracker(client, run_id, uri)


def _resolve(uri: str) -> str:
    """Make a relative SQLite path absolute: MLflow caches stores by URI, whatever the current folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and not uri.startswith(prefix + ":memory:"):
        return prefix + str(Path(uri.removeprefix(prefix)).resolve())
    return uri


def _reopen(client: Any, uri: str, experiment: str, run_id_file: Path) -> str | None:
    """The recorded run's id, set back to RUNNING, if it is alive in `experiment` on `uri`; else None."""
    from mlflow.exceptions import MlflowException

    try:
        recorded = json.loads(run_id_file.read_text(encoding="utf-8"))
        run_id, recorded_uri = str(recorded["run_id"]), recorded["tracking_uri"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if recorded_uri != _redact(uri):
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
    if run.info.lifecycle_stage != "active" or client.get_experiment(run.info.experiment_id).name != experiment:
        return None
    client.update_run(run_id, status="RUNNING")
    return run_id


def _create(client: Any, experiment: str, run_name: str | None) -> str:
    """Start a run in `experiment`, creating the experiment if needed (tolerating a concurrent creator)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(experiment)
    if found is None:
        try:
            experiment_id = client.create_experiment(experiment)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment_id = client.get_experiment_by_name(experiment).experiment_id
    else:
        experiment_id = found.experiment_id
    return client.create_run(experiment_id, run_name=run_name).info.run_id


def _retry_locked(action: Callable[[], T]) -> T:
    """Run `action`, retrying with backoff while SQLite says "database is locked" (for LOCK_PATIENCE_S at most)."""
    start = time.monotonic()
    for attempt in itertools.count():
        try:
            return action()
        except Exception as err:
            if "database is locked" not in str(err) or time.monotonic() - start > LOCK_PATIENCE_S:
                raise
            time.sleep(min(0.1 * 2**attempt, 2.0))
    raise AssertionError("unreachable")


def _redact(uri: str) -> str:
    """Drop user:password@ from a URI before printing it."""
    return re.sub(r"//[^/@\s]*@", "//", uri)


def _warn(what: str, err: Exception) -> None:
    detail = _redact(" ".join(f"{type(err).__name__}: {err}".split()))
    if len(detail) > 300:
        detail = detail[:150] + " ... " + detail[-145:]
    print(f"tracking: {what} ({detail}); going on without MLflow", file=sys.stderr, flush=True)
