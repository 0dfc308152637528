"""A stage's MLflow calls through the store's relay: one background process per SQLite store that has imported
MLflow and opened the store, so that a stage pays neither (about 3 s of CPU and 200 MB each, against a data
stage's 2 s: docs/tracking.md). The relay runs the same `open_run` and `Tracker` methods a stage would run, every
one of them (the track stage's reads, artifacts and registration too); their results and warnings come back to the
stage, which prints the warnings. A tracked stage asks the relay to hold on for it as its work starts, or starts it
then, beside that work (`warm`), so that its calls after the work find it open. It exits after IDLE_S seconds
without a call once no process it holds on for lives (those that asked, and those that opened a run through it and
have not closed it; `PIPELINE_MLFLOW_RELAY=SECONDS` sets them; a call after it ended starts it again), or when its
store file is replaced. Where no relay can start, or with `PIPELINE_MLFLOW_RELAY=off`, the stage calls MLflow
itself. The relay's socket, pid and log are in $TMPDIR/pipeline-mlflow-relay-UID/."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from pipeline.tracking import mlflow_run
from pipeline.tracking.mlflow_run import Tracker, open_run

SWITCH = "PIPELINE_MLFLOW_RELAY"  # "off": every stage calls MLflow itself; a number: the relay's idle seconds
IDLE_S = 30.0
START_S = 60.0  # how long a stage waits for a relay to open its store before calling MLflow itself
HOLD_S = 5.0  # how long `warm` waits for a busy relay to take its process as one to hold on for
REPLY_S = 120.0  # a call's longest wait (a locked SQLite store is retried for mlflow_run.LOCK_PATIENCE_S)
RELAYED = (  # the Tracker methods a relayed one sends (describe and log_metrics call set_tags and log_series)
    "log_params", "set_tags", "log_series", "log_artifact", "logged", "logged_steps", "tag_experiment", "log_datasets",
    "register_model", "close",
)  # fmt: skip
SKINNY = ("pandas", "scipy", "pyarrow")  # imported by MLflow where installed; the relay's calls use none of them
COPIES = ("log_artifact",)  # as long as the files take to copy: no reply time limit (a relay that dies ends it)


def open_relayed(**kwargs: Any) -> Tracker:
    """`open_run(**kwargs)` through the relay of the SQLite store `kwargs["uri"]` names, started if none is running;
    `open_run` in this process for other stores, with the relay switched off, or where it cannot start."""
    uri = kwargs["uri"]
    database = mlflow_run.sqlite_file(mlflow_run.resolve_uri(uri, kwargs.get("root") or Path.cwd()))
    if database is None or os.environ.get(SWITCH) == "off":
        return open_run(**kwargs)
    paths = {"run_id_file": Path(kwargs["run_id_file"]).resolve(), "root": Path(kwargs.get("root") or Path.cwd())}
    try:
        address = _address(database)
        request = {"op": "open", "kwargs": {**kwargs, **{k: str(v) for k, v in paths.items()}}}
        opened = _ask(address, request, start=database, reply_s=REPLY_S)
    except Busy as busy:  # it may still open the run: a second one opened here would be a duplicate
        mlflow_run.warn(f"opening a run on {mlflow_run.redact(uri)}", busy)
        return Tracker(uri=uri)
    except Exception:  # no relay (its folder unwritable, another one starting past START_S): the stage logs itself
        opened = None
    if opened is None or opened.get("stale"):
        return open_run(**{**kwargs, **paths})
    if opened["run_id"] is None:
        return Tracker(uri=opened["uri"], missing=opened["missing"])
    return Relayed(address=address, run_id=opened["run_id"], uri=opened["uri"])


def warm(uri: str, root: Path | None = None) -> None:
    """Keep the relay of the SQLite store `uri` names for this process while it lives: the running one is asked to
    hold on, else one is started in the background, holding on from its start. Returns at once: the stage's calls
    after its work find the relay open, the store's first `open_relayed` without waiting for MLflow's import."""
    database = mlflow_run.sqlite_file(mlflow_run.resolve_uri(uri, root or Path.cwd())) if uri else None
    if database is None or os.environ.get(SWITCH) == "off":
        return
    hold = {"op": "hold"}
    with contextlib.suppress(Exception):  # a relay busy or unable to start: the stage's first call starts one
        from filelock import FileLock, Timeout

        address = _address(database)
        if _exchange(address, hold, HOLD_S) is not None:
            return
        with contextlib.suppress(Timeout), FileLock(address.parent / "starting.lock", timeout=0):
            if _starting(address) is None and _exchange(address, hold, HOLD_S) is None:
                _spawn(address, database, holder=os.getpid())


class Relayed(Tracker):
    """A Tracker whose MLflow calls run in the relay; a failed call is warned about once and ends tracking, as
    Tracker's own do."""

    def __init__(self, *, address: Path, run_id: str, uri: str):
        super().__init__(client=address, run_id=run_id, uri=uri)

    def log_params(self, params) -> None:
        self._send("log_params", {k: str(v)[: mlflow_run.MAX_PARAM_VALUE] for k, v in params.items()})

    def set_tags(self, tags) -> None:
        self._send("set_tags", {k: str(v) for k, v in tags.items()})

    def log_series(self, series) -> None:
        self._send("log_series", {k: [[int(s), float(v)] for s, v in by_step.items()] for k, by_step in series.items()})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._send("log_artifact", str(Path(path).resolve()), artifact_path)  # the relay runs in another folder

    def logged(self) -> tuple[dict[str, float], dict[str, str]]:
        metrics, tags = self._send("logged") or ({}, {})
        return metrics, tags

    def logged_steps(self, key: str) -> set[int]:
        return set(self._send("logged_steps", key) or ())

    def tag_experiment(self, tags) -> None:
        self._send("tag_experiment", {k: str(v) for k, v in tags.items()})

    def log_datasets(self, datasets: list[dict[str, str]]) -> None:
        self._send("log_datasets", datasets)

    def register_model(self, name: str, artifact_path: str) -> str | None:
        return self._send("register_model", name, artifact_path)

    def close(self, status: str = "FINISHED") -> None:
        if not self.closed:
            self._send("close", status)
        self.closed = True

    def _send(self, method: str, *arguments: Any) -> Any:
        """The relay's result of `method(*arguments)` on its Tracker of this run (None where it failed)."""
        if self.disabled or self.closed:
            return None
        request = {"op": "call", "run_id": self.run_id, "uri": self.uri, "method": method, "arguments": arguments}
        reply_s = None if method in COPIES else REPLY_S
        gone: OSError = ConnectionError("relay gone")
        try:  # a relay that idled out is started again
            answer = _ask(self.client, request, start=mlflow_run.sqlite_file(self.uri), reply_s=reply_s)
        except Busy as busy:  # it may still carry the call out: not sent again
            answer, gone = None, busy
        except OSError:  # none can start again (its folder, the start's lock): as one gone, never the stage's end
            answer = None
        if answer is None or answer.get("stale"):
            mlflow_run.warn(f"{method} on {mlflow_run.redact(self.uri)} failed", gone)
            self.client = None
            return None
        if answer["disabled"]:
            self.client = None
        return answer.get("result")


def _code() -> Path:
    """The folder this process imported `pipeline` from: the relay it starts runs the same files."""
    import pipeline

    return Path(pipeline.__file__).parent.parent


def _address(database: Path) -> Path:
    """The relay's socket for `database`, keyed by what the relay's code and MLflow's settings are."""
    code = _code() / "pipeline" / "tracking"
    key = [str(database), sys.executable, str(code)]
    key += [f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(code.glob("*.py"))]
    key += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MLFLOW_"))
    folder = Path(tempfile.gettempdir()) / f"pipeline-mlflow-relay-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / (hashlib.sha1("\n".join(key).encode()).hexdigest()[:24] + ".sock")


class Busy(TimeoutError):
    """A relay took the call but gave no answer within its reply time: it may still carry the call out, so it is
    neither sent again nor replaced by another relay."""


def _ask(address: Path, request: dict, *, start: Path | None, reply_s: float | None) -> dict | None:
    """The relay's answer to `request` (its warnings printed here) within `reply_s` (None: as long as the relay
    lives), starting it for `start` (the store) if none takes the call; None where none can; Busy where one took it
    and did not answer in time."""
    answer = _exchange(address, request, reply_s)
    if answer is None and start is not None:
        from filelock import FileLock

        with FileLock(address.parent / "starting.lock", timeout=START_S):  # one relay starts at a time
            answer = _exchange(address, request, reply_s)
            if answer is None and _start(address, start):
                answer = _exchange(address, request, reply_s)
    for line in (answer or {}).get("warnings", []):
        mlflow_run.log.warning(line)
    return answer


def _exchange(address: Path, request: dict, reply_s: float | None) -> dict | None:
    """The answer of the relay on `address`; None where none listens there or it ended before answering."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(START_S)
        try:
            sock.connect(str(address))
            sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError:  # no socket, nobody listening on it, or a relay that ended as the call came
            return None
        sock.settimeout(reply_s)
        try:
            with sock.makefile("rb") as reply:
                line = reply.readline()
        except TimeoutError:
            raise Busy(f"the relay on {address} gave no answer within {reply_s:g} s") from None
        except OSError:
            return None
    return json.loads(line) if line else None


def _start(address: Path, database: Path) -> bool:
    """Start the relay of `database` on `address` (or wait for the one `warm` started), detached (no file of this
    process kept open); True once it answers."""
    process = _starting(address) or _spawn(address, database)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and _running(process):
        if address.exists():
            return True
        time.sleep(0.05)
    return False


def _spawn(address: Path, database: Path, holder: int | None = None) -> psutil.Process:
    """The relay of `database` on `address` (holding on while process `holder` lives), started and not waited for;
    its pid kept beside the socket."""
    with contextlib.suppress(FileNotFoundError):
        address.unlink()  # a relay that died without removing it
    log_file = address.with_suffix(".log")
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.tracking.relay", str(address), str(database), str(holder or "")],
            cwd=_code(), stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    address.with_suffix(".pid").write_text(str(process.pid))
    return psutil.Process(process.pid)


def _starting(address: Path) -> psutil.Process | None:
    """The relay started for `address` that has not opened its store yet (no socket): None where there is none."""
    try:
        process = psutil.Process(int(address.with_suffix(".pid").read_text()))
        ours = str(address) in process.cmdline()
    except (OSError, ValueError, IndexError, psutil.Error):
        return None
    return process if ours and _running(process) and not address.exists() else None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _captured() -> Iterator[list[str]]:
    handler = _Warnings()
    tracking = mlflow_run.log
    tracking.addHandler(handler)
    tracking.propagate = False  # printed by the stage that asked, not into the relay's log
    try:
        yield handler.lines
    finally:
        tracking.removeHandler(handler)
        tracking.propagate = True


def _identity(database: Path) -> tuple[int, int] | None:
    try:
        found = database.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


class _Holders:
    """The processes the relay holds on for: those that opened a run through it and have not closed it, and those
    that asked it to (`warm`, for as long as they live): pid -> (start time, holds)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[float, int]] = {}

    def update(self, pid: int, request: dict, answer: dict) -> None:
        if request["op"] == "hold" or (request["op"] == "open" and answer.get("run_id")):
            started, holds = self.held.get(pid) or (_started(pid), 0)
            if started is not None:
                self.held[pid] = (started, holds + 1)
        elif request.get("method") == "close" and pid in self.held:
            started, holds = self.held.pop(pid)
            if holds > 1:
                self.held[pid] = (started, holds - 1)

    def alive(self) -> bool:
        """Whether one of them still runs (those that ended without closing are forgotten)."""
        self.held = {pid: held for pid, held in self.held.items() if _started(pid) == held[0]}
        return bool(self.held)


def _started(pid: int) -> float | None:
    """When process `pid` started; None where it has ended."""
    try:
        process = psutil.Process(pid)
        return process.create_time() if _running(process) else None
    except psutil.Error:
        return None


def _peer(connection: socket.socket) -> int:
    """The pid of the process on the other end of a Unix socket."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[0]


def serve(address: Path, database: Path, holder: int | None = None) -> None:
    """Answer stages' calls on `address` until IDLE_S passes without one while no process it holds on for (`holder`
    among them) lives, or `database` is replaced."""
    from mlflow import MlflowClient

    uri = mlflow_run.SQLITE + str(database)
    with mlflow_run.store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store opened (its tables made)
    identity = _identity(database)
    holders = _Holders()
    if holder is not None:
        holders.update(holder, {"op": "hold"}, {})

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            request = json.loads(self.rfile.readline())
            if _identity(database) != identity:
                self.server.ended = True
                self.wfile.write(b'{"stale": true}\n')
                return
            with _captured() as warnings:
                answer = _answer(request, client)
            holders.update(_peer(self.connection), request, answer)
            self.wfile.write(json.dumps({**answer, "warnings": warnings}).encode() + b"\n")

    class Server(socketserver.UnixStreamServer):
        timeout, ended = float(os.environ.get(SWITCH) or IDLE_S), False

        def handle_timeout(self) -> None:
            self.ended = not holders.alive()

    Path(f"{address}.new").unlink(missing_ok=True)  # left by a relay that died starting (stages start one at a time)
    with Server(f"{address}.new", Handler) as server:
        os.replace(f"{address}.new", address)  # stages find it only now that the store is open
        bound = _identity(address)
        try:
            while not server.ended:
                server.handle_request()
        finally:
            if _identity(address) == bound:  # not the socket of a relay started after this one ended
                address.unlink()
    address.with_suffix(".log").unlink(missing_ok=True)  # kept where the relay failed
    with contextlib.suppress(OSError):
        if address.with_suffix(".pid").read_text() == str(os.getpid()):
            address.with_suffix(".pid").unlink()


def _answer(request: dict, client: Any) -> dict:
    """Run a stage's call with the relay's client."""
    if request["op"] == "hold":
        return {}
    if request["op"] == "open":
        kwargs = request["kwargs"]
        tracker = open_run(**{**kwargs, "run_id_file": Path(kwargs["run_id_file"]), "root": Path(kwargs["root"])})
        return {"run_id": tracker.run_id, "missing": tracker.missing, "uri": tracker.uri}
    method, arguments = request["method"], request["arguments"]
    if method not in RELAYED:
        raise ValueError(f"the relay does not run {method}")
    tracker = Tracker(client=client, run_id=request["run_id"], uri=request["uri"])
    if method == "log_series":  # JSON keys are strings: the steps travel as pairs
        arguments = [{k: {step: value for step, value in pairs} for k, pairs in arguments[0].items()}]
    result = getattr(tracker, method)(*arguments)
    if isinstance(result, set):
        result = sorted(result)
    return {"disabled": tracker.disabled, "result": result}


def skinny() -> None:
    """Make this process's MLflow import as mlflow-skinny (which has none of SKINNY) does: MLflow imports each only
    where it is installed, and a tracking client's calls need none. `import mlflow` then costs 101 MB and 2 s instead
    of 183 MB and 8 s (the SQL store's 50 MB come on top either way). For a process that imports no other library:
    a later import of one of them fails."""
    for name in SKINNY:
        sys.modules.setdefault(name, None)  # None: `import name` raises ImportError, as where it is not installed


if __name__ == "__main__":
    skinny()
    serve(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if sys.argv[3] else None)
