"""A rank server's key is what a rank's imports read (the sources' contents, not the project folder they are in, nor
DVC's or a sweep's variables), a rank it forks imports from its own request's folder, as a fresh rank would, and a
server that ends gives its place back (the forks themselves: tests/integration/test_train.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core import forking
from pipeline.launching import rank_server
from pipeline.launching.rank_server import SOURCES, key_inputs
from tests.conftest import REPO

COMMAND = [sys.executable, "-m", "pipeline.training.rank", "--plan", "plan.json", "--local_rank=0"]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin", "RANK": "0"}


def copy_sources(folder: Path) -> Path:
    shutil.copytree(REPO / SOURCES, folder / SOURCES, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_two_copies_of_the_project_share_a_key_that_their_sources_and_settings_make(tmp_path, monkeypatch):
    def key(folder: Path, env: dict) -> dict:
        monkeypatch.chdir(folder)
        return key_inputs(COMMAND, env)

    first, second = copy_sources(tmp_path / "first"), copy_sources(tmp_path / "second")
    queued = {**ENV, "DVC_EXP_NAME": "bushy-pole", "DVC_ROOT": str(second), "PWD": str(second), "RANK": "1",
              "CELERY_LOADER": "x", "PIPELINE_RUN_NAME": "lora.r=8", "PIPELINE_SWEPT_KEYS": "lora.r"}  # fmt: skip
    assert key(first, ENV) == key(second, queued)
    assert key(first, ENV) != key(second, {**ENV, "OMP_NUM_THREADS": "2"}), "a setting the imports read"
    with (second / SOURCES / "core" / "atomic.py").open("a") as edited:
        edited.write("\n")
    assert key(first, ENV) != key(second, ENV), "an edited source"


def test_a_forked_rank_imports_from_its_request_folder_once_the_server_copy_is_gone(tmp_path):
    """As a server runs (`python -m`, its copy as working folder), `rebase` to another copy, the server's removed:
    what the rank had imported names the request's folder, and what it imports next comes from there."""
    server, request = copy_sources(tmp_path / "server"), copy_sources(tmp_path / "request")
    (server / "probe.py").write_text(
        "import json, os, shutil, sys\n"
        "from pipeline.launching import rank_server\n"
        "rank_server.rebase(os.getcwd(), sys.argv[1])\n"
        "shutil.rmtree(os.getcwd())\n"
        "from pipeline.core import atomic\n"
        "import pipeline\n"
        "print(json.dumps([rank_server.__file__, atomic.__file__, *pipeline.__path__, sys.path[0]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "probe", str(request)], cwd=server, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    for path in json.loads(done.stdout):
        assert Path(path).is_relative_to(request), path


# A server without a rank's imports (what it serves is the same), idling out within a second
SERVER = [sys.executable, "-c", "import os; from pipeline.core import forking as f; from pipeline.launching import"
          " rank_server as r; f.IDLE_S, f.POLL_S = 1, 0.1; r.serve(os.environ[r.SERVE])"]  # fmt: skip


def test_a_server_that_ends_gives_its_place_back_and_its_key_gets_one_again(tmp_path, tmp_path_factory, monkeypatch):
    """The second launch of a key starts its server, up to MAX_SERVERS running at once; one that idles out withdraws
    its socket, pid and mark, so that a waiting key gets the place and its own key a server again (from the copy of
    the sources it kept); one killed without withdrawing is replaced."""
    folder = tmp_path_factory.mktemp("servers")  # short: a socket's path holds 107 bytes
    monkeypatch.chdir(copy_sources(tmp_path / "project"))
    monkeypatch.setattr(forking, "MAX_SERVERS", 1)
    inputs = {"env": dict(os.environ), "sources": "digest"}
    first, second = folder / "first.sock", folder / "second.sock"

    def launch(path: Path) -> None:
        rank_server.start_server(path, command=SERVER, inputs=inputs)

    def wait(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, (what, sorted(p.name for p in folder.iterdir()))
            time.sleep(0.05)

    def serving(path: Path) -> bool:  # a connection that asks nothing: no rank forked (the logs stay empty)
        with socket.socket(socket.AF_UNIX) as client:
            return client.connect_ex(str(path)) == 0

    launch(first)
    assert not first.with_suffix(".started").exists(), "a key seen once has no server"
    launch(first)
    wait(lambda: serving(first), "the first key's server")
    copied = (first.with_suffix(".sources") / SOURCES).stat().st_ino
    launch(second)
    launch(second)
    assert not second.with_suffix(".started").exists(), "one server at most"
    wait(lambda: not any(first.with_suffix(s).exists() for s in (".sock", ".pid", ".started")), "the first withdrawn")
    launch(second)
    wait(lambda: serving(second), "the second key's server in the place given back")
    launch(first)
    assert not first.with_suffix(".started").exists(), "one server at most"
    pid = int(second.with_suffix(".pid").read_text())
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)  # as the stage that started it would reap it (or init, once the stage is gone)
    assert second.with_suffix(".started").exists(), "killed: nothing withdrawn"
    launch(first)
    wait(lambda: serving(first), "the first key's server again, in the place of the killed one")
    assert (first.with_suffix(".sources") / SOURCES).stat().st_ino == copied, "its copy of the sources again"
    wait(lambda: not first.with_suffix(".started").exists(), "the first withdrawn again")
    assert all(not log.read_text() for log in folder.glob("*.log")), [log.read_text() for log in folder.glob("*.log")]
