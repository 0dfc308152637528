"""Ranks forked from an interpreter that has already done a rank's imports (torch, DeepSpeed, PEFT, transformers:
about 5 s of CPU per rank), for runs launched again and again on one machine: the test suite's, a sweep of tiny
runs. Off unless `TRAIN_RANK_SERVERS` names a folder (tests/conftest.py sets it). The servers themselves (keys,
sockets, monitors, places): `core/forking.py`.

A server is a rank's own process (`python -m pipeline.training.rank`, the same command line, environment and
working folder) that stops where a rank waits for its release and forks a rank for each request instead; the forked
rank then runs on as the one started fresh would. It serves only ranks whose every input to those imports is its
own: the key of a server is the rank command, its environment but for what the imports never read, the contents of
its `pipeline/` sources, this session (the process group the ranks join) and the interpreter. Not the working folder:
every copy of the project (DVC's queued experiments run in temporary ones) shares a server, which runs from its own
copy of the sources and hands each rank it forks the folder of its request (`rebase`). A launch with no server for its
key starts its ranks fresh; the second one also starts the key's server, in the background."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from pipeline.core import forking

FOLDER = "TRAIN_RANK_SERVERS"  # where servers listen (one socket per key); unset: every rank starts fresh
SERVE = "TRAIN_RANK_SERVE"  # in a server's environment: the socket it listens on
SOURCES = "pipeline"  # the package a rank imports from its working folder


def key_inputs(command: list[str], env: dict[str, str], *, skip: tuple[str, ...] = ()) -> dict:
    """What a rank's imports depend on: everything but the variables read after them (and `skip`) and the rank's
    own arguments."""
    return {"command": [a for a in command if not a.startswith("--local_rank")][:3],
            "env": forking.key_environment(env, skip=(*skip, FOLDER)), "session": os.getsid(0),
            "python": sys.executable, "sources": forking.sources_digest(Path.cwd() / SOURCES)}  # fmt: skip


def fork(command: list[str], *, env: dict[str, str], release: tuple[str, int]) -> forking.Forked | None:
    """A rank forked by the server of its key, with `env`, the rank's arguments and its release pipe (`release`: the
    variable that names it, and the pipe's end); None where there is none (then the caller starts it fresh: the
    second launch of a key starts its server)."""
    folder = os.environ.get(FOLDER)
    if not folder:
        return None
    variable, release_fd = release
    inputs = key_inputs(command, env, skip=(variable,))
    path = forking.socket_path(folder, inputs)
    message = {"argv": command[3:], "env": env, "pgid": os.getpgrp(), "cwd": str(Path.cwd()), "release": variable}
    forked = forking.request(path, message, [release_fd, 0, 1, 2])
    if forked is None and env.get("LOCAL_RANK") == "0":  # once a launch; one that cannot start leaves ranks fresh
        with contextlib.suppress(OSError):  # a full disk
            start_server(path, command=command, inputs=inputs)
    return forked


def start_server(path: Path, *, command: list[str], inputs: dict) -> None:
    """The server of a key seen for the second time (`forking.start_server`), from its own copy of the sources (the
    first project's may be gone: DVC removes a queued experiment's folder after it), kept for a restart."""
    if not path.with_suffix(".json").exists():
        forking.start_server(path, command=command, env=inputs["env"], inputs=inputs, cwd=Path.cwd())  # notes it
        return
    sources = path.with_suffix(".sources")
    if not sources.exists():
        staging = path.with_suffix(f".{os.getpid()}")
        shutil.copytree(Path.cwd() / SOURCES, staging / SOURCES, ignore=shutil.ignore_patterns("__pycache__"))
        staging.rename(sources)
    rank_command = [a for a in command if not a.startswith("--local_rank")]
    forking.start_server(path, command=rank_command, env={**inputs["env"], SERVE: str(path)}, inputs=inputs,
                         cwd=sources)  # fmt: skip


def serve(path: str) -> None:
    """In a server, once the imports are done: fork a rank for each request. Returns only in a forked rank, with the
    request's arguments, environment, working folder, process group, standard streams and release pipe."""
    request, (release, *streams) = forking.serve(path)
    server = os.getcwd()
    forking.become(request, streams)
    rebase(server, request["cwd"])
    os.environ[request["release"]] = str(release)
    sys.argv = [sys.argv[0], *request["argv"]]


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
