"""MLflow tracking: one run per pipeline execution, shared by its stages through a run-id file; never fatal."""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pipeline.core.atomic import read_json, write_json
from pipeline.core.log import logger
from pipeline.tracking.runs_view import EXPERIMENT_TAGS

log = logger("tracking")

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
SQLITE = "sqlite:///"


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


def numeric_leaves(figures: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested figures -> {"eval.in_domain.base.perplexity": 22.4}: numbers only (no booleans, strings or None)."""
    flat: dict[str, float] = {}
    for name, value in figures.items():
        key = f"{prefix}{_BAD_KEY_CHARS.sub('_', str(name))}"
        if isinstance(value, Mapping):
            flat.update(numeric_leaves(value, f"{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


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

    def __init__(self, *, client: Any = None, run_id: str | None = None, uri: str = "", missing: str | None = None):
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.missing = missing  # why this execution has no run (None: it has one, or tracking is off)
        self.closed = False

    @property
    def disabled(self) -> bool:
        """True when tracking is off: no URI, or an MLflow call failed."""
        return self.client is None

    def log_params(self, params: Mapping[str, object]) -> None:
        """Log params (values as strings, truncated to MLflow's limit); re-logging an equal value is fine."""

        def log() -> None:
            from mlflow.entities import Param

            items = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()]
            for start in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=items[start : start + 100])

        self._call("log_params", log)

    def set_tags(self, tags: Mapping[str, object]) -> None:
        """Set run tags (overwriting earlier values)."""

        def log() -> None:
            from mlflow.entities import RunTag

            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

        self._call("set_tags", log)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log metrics at `step` (0 when None)."""
        self.log_series({k: {step or 0: v} for k, v in metrics.items()})

    def log_series(self, series: Mapping[str, Mapping[int, float]]) -> None:
        """Log whole metric histories: {"loss": {1: 3.1, 2: 2.9}} (one value per step)."""

        def log() -> None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            items = [Metric(k, float(v), now, step) for k, by_step in series.items() for step, v in by_step.items()]
            for start in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics a batch
                self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

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

    def logged(self) -> tuple[dict[str, float], dict[str, str]]:
        """The run's latest metric values and its tags, as MLflow has them ({} and {} when disabled)."""
        found: list = []
        self._call("get_run", lambda: found.append(self.client.get_run(self.run_id).data))
        return (found[0].metrics, found[0].tags) if found else ({}, {})

    def logged_steps(self, key: str) -> set[int]:
        """The steps at which metric `key` was logged."""
        found: list = []
        self._call("get_metric_history", lambda: found.extend(self.client.get_metric_history(self.run_id, key)))
        return {m.step for m in found}

    def tag_experiment(self, tags: Mapping[str, str]) -> None:
        """Set tags of the run's experiment (overwriting earlier values)."""

        def log() -> None:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
            for key, value in tags.items():
                self.client.set_experiment_tag(experiment_id, key, value)

        self._call("set_experiment_tag", log)

    def describe(self, markdown: str) -> None:
        """The run's description, shown at the top of its page in the MLflow UI."""
        self.set_tags({"mlflow.note.content": markdown})

    def log_datasets(self, datasets: list[dict[str, str]]) -> None:
        """Datasets as the run's inputs: each {"name", "digest", "source", "context"} (context: training or
        evaluation), so that the run page lists what it was trained and evaluated on."""

        def log() -> None:
            from mlflow.entities import Dataset, DatasetInput, InputTag

            inputs = [
                DatasetInput(
                    Dataset(name=d["name"], digest=d["digest"][:36], source_type="local", source=d["source"]),
                    tags=[InputTag("mlflow.data.context", d["context"])],
                )
                for d in datasets
            ]
            self.client.log_inputs(self.run_id, datasets=inputs)

        self._call("log_inputs", log)

    def register_model(self, name: str, artifact_path: str) -> str | None:
        """Register the run's artifact folder `artifact_path` as a new version of model `name`; its version."""
        versions: list = []

        def register() -> None:
            from mlflow.exceptions import MlflowException

            try:
                self.client.create_registered_model(name)
            except MlflowException as err:
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
            versions.append(self.client.create_model_version(name, source, run_id=self.run_id).version)

        self._call("register_model", register)
        return str(versions[0]) if versions else None

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
            warn(f"{what} on {redact(self.uri)} failed", err)
            self.client = None


def open_run(
    uri: str,
    experiment: str,
    run_id_file: Path,
    *,
    execution: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    root: Path | None = None,
) -> Tracker:
    """The run of pipeline execution `execution`: the one `run_id_file` records for it, else a new one (recorded
    there). A relative SQLite path is taken from `root` (default: the current folder). When MLflow cannot be
    reached the file marks the execution's run missing: one warning, and its later stages do not try again."""
    if not uri:
        return Tracker()
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    uri = resolve_uri(uri, root or Path.cwd())
    run_id_file = Path(run_id_file)
    recorded = _read_record(run_id_file)
    same_store = recorded.get("tracking_uri") == redact(uri)
    same_execution = same_store and recorded.get("execution") == execution
    if same_execution and recorded.get("missing"):
        return Tracker(uri=uri, missing=recorded["missing"])
    try:
        from mlflow import MlflowClient

        with store_lock(uri):
            client = MlflowClient(tracking_uri=uri)
            run_id = _retry_locked(lambda: _reopen(client, experiment, recorded["run_id"])) if same_execution else None
            if run_id is None:
                if recorded.get("run_id") and same_store:
                    _retry_locked(lambda: _end_interrupted(client, recorded["run_id"]))
                tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
                run_id = _retry_locked(
                    lambda: _create(client, experiment, run_name=run_name, tags=tags, artifact_root=_artifact_root(uri))
                )
    except Exception as err:  # tracking must never stop training
        warn(f"cannot open a run on {redact(uri)}", err)
        reason = f"{type(err).__name__} on {redact(uri)}"
        write_json(run_id_file, {"execution": execution, "missing": reason, "tracking_uri": redact(uri)})
        return Tracker(uri=uri, missing=reason)
    write_json(run_id_file, {"execution": execution, "run_id": run_id, "tracking_uri": redact(uri)})
    return Tracker(client=client, run_id=run_id, uri=uri)


def resolve_uri(uri: str, root: Path) -> str:
    """Make a relative SQLite path absolute under `root`: MLflow caches stores by URI, whatever the current folder."""
    path = uri.removeprefix(SQLITE)
    if uri.startswith(SQLITE) and not path.startswith("/") and path != ":memory:":
        return SQLITE + str((root / path).resolve())
    return uri


def _read_record(run_id_file: Path) -> dict:
    try:
        recorded = read_json(run_id_file)
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def sqlite_file(uri: str) -> Path | None:
    """The database file of a SQLite store (None for a server or an in-memory store)."""
    return None if not uri.startswith(SQLITE) or uri.endswith(":memory:") else Path(uri.removeprefix(SQLITE))


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database (`mlartifacts/`), not below the current folder."""
    database = sqlite_file(uri)
    return None if database is None else (database.parent / "mlartifacts").as_uri()


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise the opening of a SQLite store: two processes creating its tables at once collide."""
    database = sqlite_file(uri)
    if database is None:
        yield
        return
    from filelock import FileLock

    database.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{database}.lock", timeout=120):
        yield


def _reopen(client: Any, experiment: str, run_id: str) -> str | None:
    """`run_id`, set back to RUNNING, if it is alive in `experiment`; else None."""
    from mlflow.exceptions import MlflowException

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


def _end_interrupted(client: Any, run_id: str) -> None:
    """A run an earlier execution left RUNNING was interrupted (killed, or stopped by a failure outside a stage)."""
    from mlflow.exceptions import MlflowException

    try:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise


def _create(client: Any, experiment: str, *, run_name: str | None, tags: dict, artifact_root: str | None) -> str:
    """Start a run in `experiment`, creating the experiment if needed (tolerating a concurrent creator)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(experiment)
    if found is None:
        location = f"{artifact_root}/{_BAD_KEY_CHARS.sub('_', experiment)}" if artifact_root else None
        try:
            experiment_id = client.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_TAGS)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment_id = client.get_experiment_by_name(experiment).experiment_id
    else:
        experiment_id = found.experiment_id
        for key, value in EXPERIMENT_TAGS.items():
            if found.tags.get(key) != value:
                client.set_experiment_tag(experiment_id, key, value)
    return client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id


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


def redact(uri: str) -> str:
    """Drop user:password@ from a URI before printing it."""
    return re.sub(r"//[^/@\s]*@", "//", uri)


def warn(what: str, err: Exception) -> None:
    detail = redact(" ".join(f"{type(err).__name__}: {err}".split()))
    if len(detail) > 300:
        detail = detail[:150] + " ... " + detail[-145:]
    log.warning(f"{what} ({detail}); going on without MLflow")
