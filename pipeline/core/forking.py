"""Servers of interpreters that have already done their imports, each forking a process per request: the rank
servers (`launching/rank_server.py`: a rank's torch, DeepSpeed, PEFT and transformers) and the stage servers
(`core/stage_server.py`: a stage's torch, transformers and PEFT), for runs started again and again on one machine
(the test suite's). Off unless a variable names the folder they listen in.

A server's key is what its imports read: the command, the environment but for what they never read, the sources'
contents, the session (a forked process joins its requester's process group) and the interpreter. The first request
of a key writes down its inputs (`KEY.json`) and is started fresh; the second starts the key's server in the
background (MAX_SERVERS at most at once); later ones connect to `KEY.sock`, hand over their standard streams
(SCM_RIGHTS) and get a process forked for them: a monitor tells its pid, then its exit code, and ends it if the
requester goes away first. A server unused for IDLE_S, or whose folder or owner is gone, withdraws its socket, pid and
mark and exits, which gives its place to the next key started twice. Standard library only: a requester pays
nothing for it but the connection."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# What no server's imports read, so that one server serves requests that differ in it: the per-rank variables, the
# stage's pipeline execution and a sweep's run names (pipeline/tracking/), MLflow's settings (MLflow is imported
# later), pytest's current test, the shell's folder, DVC's and its queue's (Celery's) own.
AFTER_IMPORTS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PIPELINE_EXECUTION", "PIPELINE_RUN_NAME", "PIPELINE_MLFLOW_PARENT_RUN_ID",
                 "PIPELINE_SWEPT_KEYS", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "_")  # fmt: skip
AFTER_IMPORTS_PREFIXES = ("MLFLOW_", "DVC_", "CELERY_", "_MP_FORK_")
MAX_SERVERS = 4  # in one folder; each holds its imports (about 400 MB)
IDLE_S = 300  # a server unused this long exits (its place goes to another key), as one whose folder or owner is gone
POLL_S = 5.0  # how often a waiting server looks at its idle time, folder and owner


class Forked:
    """A process forked by a server, as a `subprocess.Popen` is used: pid, poll, wait, signals. Its exit code comes
    from the server's monitor, which waits for it (negative: the signal that ended it)."""

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
            with contextlib.suppress(ProcessLookupError):  # it has just ended: its monitor reaps it
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _read(self) -> None:
        data = self.connection.recv(64)
        self.connection.close()
        self.returncode = int(data) if data else -signal.SIGKILL  # a monitor that died took no status with it


def key_environment(env: dict[str, str], *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """`env` less the variables no server's imports read (and `skip`), sorted."""
    return dict(sorted((k, v) for k, v in env.items() if k not in (*AFTER_IMPORTS, *skip)
                       and not k.startswith(AFTER_IMPORTS_PREFIXES)))  # fmt: skip


def sources_digest(*folders: Path) -> str:
    """The contents of every file under `folders` but compiled bytecode, with their paths in it."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(f"{folder.name}/{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def socket_path(folder: str | Path, inputs: dict) -> Path:
    """Where the server of the key `inputs` listens."""
    return Path(folder) / f"{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:20]}.sock"


def request(path: Path, message: dict, fds: list[int]) -> Forked | None:
    """A process forked by the server at `path` for `message` (read by its `serve` caller), handed `fds`; None
    where no server listens there."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
    except OSError:  # none yet, or one that has ended
        connection.close()
        return None
    try:
        socket.send_fds(connection, [json.dumps(message).encode()], fds)
        connection.settimeout(60)
        pid = connection.recv(32)
        connection.settimeout(None)
        if not pid:
            raise RuntimeError(f"the server of {path} forked nothing: see {path.with_suffix('.log')}")
    except BaseException:
        connection.close()  # what the server may have forked ends with it (its monitor sees the requester go)
        raise
    return Forked(connection, int(pid))


def start_server(path: Path, *, command: list[str], env: dict[str, str], inputs: dict, cwd: Path) -> None:
    """The server of a key seen for the second time, in the background (`command` in `cwd`, its output in
    `KEY.log`), unless the key has one running or MAX_SERVERS run (a server that ends withdraws its marks, so a key
    whose server idled out gets one again). The first request of a key writes down its inputs, `KEY.json`, to tell
    why two requests do not share a server."""
    seen = path.with_suffix(".json")
    if not seen.exists():
        seen.write_text(json.dumps({**inputs, "sources": len(inputs.get("sources", ""))}, indent=1))
        return
    mark = path.with_suffix(".started")
    if sum(running(other) for other in path.parent.glob("*.started")) >= MAX_SERVERS:
        return
    if mark.exists() and not running(mark):  # one that died without withdrawing (killed)
        mark.unlink(missing_ok=True)
    try:
        claim = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one request starts it, not two at once
    except FileExistsError:
        return
    os.write(claim, str(os.getpid()).encode())  # the starter's pid until the server's: stale if the starter dies
    os.close(claim)
    try:
        with open(path.with_suffix(".log"), "ab") as log:
            server = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        pid_file = path.with_suffix(f".{os.getpid()}.mark")
        pid_file.write_text(str(server.pid))
        os.replace(pid_file, mark)
    except BaseException:
        mark.unlink(missing_ok=True)
        raise


def running(mark: Path) -> bool:
    """Whether the server of a `.started` mark runs (or is being started): the mark holds its pid (the starter's,
    until the server's replaces it; nothing for the instant between its creation and the first)."""
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


def serve(path: str) -> tuple[dict, list[int]]:
    """In a server, once the imports are done: fork a process for each request. Returns only in a forked one, with
    the request's message and the descriptors handed over (its standard streams last: 0, 1 and 2 already)."""
    if threading.active_count() != 1:  # a thread's locks would be held forever in a forked child
        sys.exit(f"server: {threading.active_count()} threads after the imports; not serving")
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
            message, fds, _flags, _address = socket.recv_fds(connection, 1 << 20, 8)
        except OSError:  # a requester that connected and died
            message, fds = b"", []
        if not message:  # nothing asked (one that closed at once): nothing forked
            connection.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()  # nothing of the server's output written again by a child
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            request = json.loads(message)
            monitor(connection, fds, request)  # returns in the forked process only
            return request, fds
        connection.close()
        for fd in fds:
            os.close(fd)
    sys.exit(0)


def monitor(connection: socket.socket, fds: list[int], request: dict) -> None:
    """In the monitor forked for a request: fork the process, tell the requester its pid, wait for it and tell its
    exit code; end it if the requester goes away first (its connection closed). Returns in the forked process."""
    child = os.fork()
    if not child:
        connection.close()
        return
    for fd in fds:
        os.close(fd)
    print(f"server {os.getppid()}: {child} forked, {' '.join(request['argv'])}", flush=True)
    with contextlib.suppress(OSError):  # a requester that died meanwhile
        connection.sendall(str(child).encode())
    ended = os.pidfd_open(child)
    while ended not in select.select([ended, connection], [], [])[0]:
        try:
            gone = not connection.recv(1)  # it sends nothing more: readable only once it has gone
        except OSError:
            gone = True
        if gone:  # so is what it asked for
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            break
    _, status = os.waitpid(child, 0)
    with contextlib.suppress(OSError):
        connection.sendall(str(os.waitstatus_to_exitcode(status)).encode())
    os._exit(0)


def owner_alive(folder: Path) -> bool:
    """The folder is there and the process that made it (its `owner` file: the test session) still runs."""
    try:
        os.kill(int((folder / "owner").read_text()), 0)
    except FileNotFoundError:
        return folder.exists()
    except (ProcessLookupError, ValueError):
        return False
    return True


def become(request: dict, streams: list[int]) -> None:
    """In a forked process: the request's standard streams, process group, folder and environment, and random
    state seeded from the system, as a fresh interpreter's."""
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    with contextlib.suppress(OSError):  # with the requester's other children, as a process it started itself
        os.setpgid(0, request["pgid"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # not shared by every process forked
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
