"""Ranks forked from an interpreter that has already done a rank's imports (torch, DeepSpeed, PEFT, transformers:
about 5 s of CPU per rank), for runs launched again and again on one machine: the test suite's, a sweep of tiny
runs. Off unless `TRAIN_RANK_SERVERS` names a folder (tests/conftest.py sets it).

A server is a rank's own process (`python -m pipeline.training.rank`, the same command line, environment and
working folder) that stops where a rank waits for its release and forks a rank for each request instead; the forked
rank then runs on as the one started fresh would. It serves only ranks whose every input to those imports is its
own: the key of a server is the rank command, its environment but for what the imports never read, the contents of
its `pipeline/` sources, this session (the process group the ranks join) and the interpreter. Not the working folder:
every copy of the project (DVC's queued experiments run in temporary ones) shares a server, which runs from its own
copy of the sources and hands each rank it forks the folder of its request (`rebase`). A launch with no server for its
key starts its ranks fresh; the second one also starts the key's server, in the background (MAX_SERVERS at
most at once: one that idles out gives its place back, and its key gets a server again at its next launch)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

FOLDER = "TRAIN_RANK_SERVERS"  # where servers listen (one socket per key); unset: every rank starts fresh
SERVE = "TRAIN_RANK_SERVE"  # in a server's environment: the socket it listens on
# What a rank's imports never read, so that one server serves launches that differ in it: the per-rank variables,
# the stage's pipeline execution and a sweep's run names (pipeline/tracking/), MLflow's settings (MLflow is imported
# after the release), pytest's current test, the shell's folder, DVC's and its queue's (Celery's) own.
AFTER_IMPORTS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PIPELINE_EXECUTION", "PIPELINE_RUN_NAME", "PIPELINE_MLFLOW_PARENT_RUN_ID",
                 "PIPELINE_SWEPT_KEYS", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "_")  # fmt: skip
AFTER_IMPORTS_PREFIXES = ("MLFLOW_", "DVC_", "CELERY_", "_MP_FORK_")
MAX_SERVERS = 4  # each holds a rank's imports (about 400 MB)
IDLE_S = 300  # a server unused this long exits (its place goes to another key), as one whose folder or owner is gone
POLL_S = 5.0  # how often a waiting server looks at its idle time, folder and owner
SOURCES = "pipeline"  # the package a rank imports from its working folder


class Forked:
    """A rank forked by a server, as the stage's launch uses a `subprocess.Popen`: pid, poll, wait, signals. Its exit
    code comes from the server's monitor, which waits for it (negative: the signal that ended it)."""

    def __init__(self, connection: socket.socket, pid: int):
        self.connection, self.pid, self.returncode = connection, pid, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self._read()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _read(self) -> None:
        data = self.connection.recv(64)
        self.connection.close()
        self.returncode = int(data) if data else -signal.SIGKILL  # a monitor that died took no status with it


def after_imports(variable: str, *, skip: tuple[str, ...] = ()) -> bool:
    return variable in (*AFTER_IMPORTS, *skip, FOLDER) or variable.startswith(AFTER_IMPORTS_PREFIXES)


def key_inputs(command: list[str], env: dict[str, str], *, skip: tuple[str, ...] = ()) -> dict:
    """What a rank's imports depend on: everything but the variables read after them (and `skip`) and the rank's
    own arguments."""
    return {"command": [a for a in command if not a.startswith("--local_rank")][:3],
            "env": dict(sorted((k, v) for k, v in env.items() if not after_imports(k, skip=skip))),
            "session": os.getsid(0), "python": sys.executable,
            "sources": sources_digest(Path.cwd() / SOURCES)}  # fmt: skip


def sources_digest(folder: Path) -> str:
    """The contents of every file under `folder` but compiled bytecode, with their paths in it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fork(command: list[str], *, env: dict[str, str], release: tuple[str, int]) -> Forked | None:
    """A rank forked by the server of its key, with `env`, the rank's arguments and its release pipe (`release`: the
    variable that names it, and the pipe's end); None where there is none (then the caller starts it fresh: the
    second launch of a key starts its server)."""
    folder = os.environ.get(FOLDER)
    if not folder:
        return None
    variable, release_fd = release
    inputs = key_inputs(command, env, skip=(variable,))
    path = Path(folder) / f"{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:20]}.sock"
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
    except OSError:  # none yet, or one that has ended
        connection.close()
        if env.get("LOCAL_RANK") == "0":  # once a launch; one that cannot start (a full disk) leaves ranks fresh
            with contextlib.suppress(OSError):
                start_server(path, command=command, inputs=inputs)
        return None
    request = {"argv": command[3:], "env": env, "pgid": os.getpgrp(), "cwd": str(Path.cwd()), "release": variable}
    socket.send_fds(connection, [json.dumps(request).encode()], [release_fd, 0, 1, 2])
    connection.settimeout(60)
    pid = connection.recv(32)
    connection.settimeout(None)
    if not pid:
        raise RuntimeError(f"the rank server of {path} forked no rank: see {path.with_suffix('.log')}")
    return Forked(connection, int(pid))


def start_server(path: Path, *, command: list[str], inputs: dict) -> None:
    """The server of a key seen for the second time, in the background, unless the key has one running or
    MAX_SERVERS run (a server that ends withdraws its marks, so a key whose server idled out gets one again). The
    first launch of a key writes down its inputs, `KEY.json`, to tell why two launches do not share a server."""
    seen = path.with_suffix(".json")
    if not seen.exists():
        seen.write_text(json.dumps({**inputs, "sources": len(inputs["sources"])}, indent=1))
        return
    mark = path.with_suffix(".started")
    if sum(running(other) for other in path.parent.glob("*.started")) >= MAX_SERVERS:
        return
    if mark.exists() and not running(mark):  # one that died without withdrawing (killed)
        mark.unlink(missing_ok=True)
    try:
        claim = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one launch starts it, not two at once
    except FileExistsError:
        return
    os.write(claim, str(os.getpid()).encode())  # this launch's pid until the server's: stale if the launch dies
    os.close(claim)
    try:
        sources = path.with_suffix(".sources")  # its own copy (the first project's may be gone), kept for a restart
        if not sources.exists():
            staging = path.with_suffix(f".{os.getpid()}")
            shutil.copytree(Path.cwd() / SOURCES, staging / SOURCES, ignore=shutil.ignore_patterns("__pycache__"))
            staging.rename(sources)
        with open(path.with_suffix(".log"), "ab") as log:
            rank_command = [a for a in command if not a.startswith("--local_rank")]
            server = subprocess.Popen(rank_command, env={**inputs["env"], SERVE: str(path)}, cwd=sources,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
        pid_file = path.with_suffix(f".{os.getpid()}.mark")
        pid_file.write_text(str(server.pid))
        os.replace(pid_file, mark)
    except BaseException:
        mark.unlink(missing_ok=True)
        raise


def running(mark: Path) -> bool:
    """Whether the server of a `.started` mark runs (or is being started): the mark holds its pid (the starting
    launch's, until the server's replaces it; nothing for the instant between its creation and the first)."""
    try:
        pid = mark.read_text()
        if pid:
            os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def withdraw(path: Path) -> None:
    """A server that ends: first its socket (no request connects any more), then its pid and its mark."""
    for suffix in (".sock", ".pid", ".started"):
        path.with_suffix(suffix).unlink(missing_ok=True)


def serve(path: str) -> None:
    """In a server, once the imports are done: fork a rank for each request. Returns only in a forked rank, with the
    request's arguments, environment, working folder, process group and standard streams."""
    if threading.active_count() != 1:  # a thread's locks would be held forever in a forked child
        sys.exit(f"rank server: {threading.active_count()} threads after the imports; not serving")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(8)
    Path(path).with_suffix(".pid").write_text(str(os.getpid()))
    os.replace(staging, path)  # the socket appears ready to accept
    listener.settimeout(POLL_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped as they end
    last = time.monotonic()
    while True:
        if listener.gettimeout() and not (owner_alive(Path(path).parent) and time.monotonic() - last < IDLE_S):
            withdraw(Path(path))
            listener.settimeout(0)  # a request that connected before is still served, then the server ends
        try:
            connection, _ = listener.accept()
        except (TimeoutError, BlockingIOError):
            if listener.gettimeout() == 0:
                break
            continue
        last = time.monotonic()
        connection.settimeout(10)
        try:
            message, fds, _flags, _address = socket.recv_fds(connection, 1 << 20, 4)
        except OSError:  # a stage that connected and died
            message, fds = b"", []
        if not message:  # nothing asked (one that closed at once): no rank
            connection.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()  # nothing of the server's output written again by a rank
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            become_rank(json.loads(message), fds, connection)  # returns in the rank only
            return
        connection.close()
        for fd in fds:
            os.close(fd)
    sys.exit(0)


def owner_alive(folder: Path) -> bool:
    """The folder is there and the process that made it (its `owner` file: the test session) still runs."""
    try:
        os.kill(int((folder / "owner").read_text()), 0)
    except FileNotFoundError:
        return folder.exists()
    except (ProcessLookupError, ValueError):
        return False
    return True


def become_rank(request: dict, fds: list[int], connection: socket.socket) -> None:
    """In the monitor forked for a request: fork the rank, tell the stage its pid, wait for it and tell its exit
    code. In the rank: the request's state, then back to the rank's main."""
    rank = os.fork()
    if rank:
        for fd in fds:
            os.close(fd)
        print(f"rank server {os.getppid()}: rank {rank} forked, {' '.join(request['argv'])}", flush=True)
        with contextlib.suppress(OSError):  # a stage that died meanwhile
            connection.sendall(str(rank).encode())
        _, status = os.waitpid(rank, 0)
        with contextlib.suppress(OSError):
            connection.sendall(str(os.waitstatus_to_exitcode(status)).encode())
        os._exit(0)
    connection.close()
    release, *streams = fds
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    with contextlib.suppress(OSError):  # with the stage's other children, as a rank it started itself
        os.setpgid(0, request["pgid"])
    rebase(os.getcwd(), request["cwd"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[request["release"]] = str(release)
    sys.argv = [sys.argv[0], *request["argv"]]
    random.seed()  # seeded from the system as a fresh interpreter's are, not shared by every rank forked
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def rebase(server: str, folder: str) -> None:
    """The forked rank's `pipeline` as if imported from `folder` (the same contents: they are in the key): its
    modules' paths (its main's too), `argv[0]` and the search path name `folder` instead of the server's copy, so
    that what it imports later and what it starts from its package's folder (the MLflow relay) come from the
    request's project, as a fresh rank's would."""
    sys.path[:] = [folder if entry == server else entry for entry in sys.path]
    prefix = os.path.join(server, "")

    def moved(path: str | None) -> str | None:
        return os.path.join(folder, path[len(prefix) :]) if path and path.startswith(prefix) else path

    sys.argv[0] = moved(sys.argv[0])
    for name, module in list(sys.modules.items()):
        if name not in ("__main__", SOURCES) and not name.startswith(f"{SOURCES}."):
            continue
        module.__file__ = moved(getattr(module, "__file__", None))
        if hasattr(module, "__path__"):
            module.__path__ = [moved(entry) for entry in module.__path__]
        if module.__spec__ is not None:
            module.__spec__.origin = moved(module.__spec__.origin)
            if module.__spec__.submodule_search_locations is not None:
                module.__spec__.submodule_search_locations = module.__path__
