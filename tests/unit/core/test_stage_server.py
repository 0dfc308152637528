"""A stage forked by a stage server runs as a fresh `python -m` does: its arguments, folder, environment, standard
streams, process group and exit code, its modules imported from its own project's folder; a signal to the process
DVC started reaches it, and killing that process ends it; a stage whose run needs what the server's imports hid
starts itself fresh again. The model stages forked in a whole pipeline: tests/integration/test_repro_check.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core import stage_server
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # the server imports torch, transformers and PEFT (about 5 s of CPU)

# A stand-in stage: says what it sees (one JSON line), echoes its standard input to stderr, then does as told
PROBE = """
import json, os, sys, time
from pipeline.core import atomic, imports, stage_server
if sys.argv[1] == "needs-bitsandbytes" and imports.unused_hidden():
    stage_server.start_fresh()
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "pgid": os.getpgrp(),
        "torch_imported": "torch" in sys.modules, "atomic": atomic.__file__,
        "setting": os.environ.get("PIPELINE_RUN_NAME")}
print(json.dumps(seen), flush=True)
sys.stderr.write(sys.stdin.read())
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
"""


def project(folder: Path) -> Path:
    """A project with our sources whose `stages.probe` is served."""
    shutil.copytree(REPO / "pipeline", folder / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "stages").mkdir()
    (folder / "stages" / "__init__.py").write_text(
        "from pipeline.core import stage_server\nstage_server.hand_over(('stages.probe',))\n"
    )
    (folder / "stages" / "probe.py").write_text(PROBE)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server folder (short: a socket's path holds 107 bytes), two copies of a project, and the server of their key,
    which the first copy's second start of the stage started."""
    folder, root = tmp_path_factory.mktemp("stage"), tmp_path_factory.mktemp("projects")
    session = os.environ.get(stage_server.FOLDER)  # the session's servers (tests/conftest.py), given back after
    os.environ[stage_server.FOLDER] = str(folder)
    try:
        first, second = project(root / "first"), project(root / "second")
        for _ in range(2):
            probe(first, "run", "0")
        deadline = time.monotonic() + 120
        while not list(folder.glob("*.sock")):
            assert time.monotonic() < deadline, [log.read_text() for log in folder.glob("*.log")]
            time.sleep(0.2)
        yield folder, first, second
    finally:
        os.environ.pop(stage_server.FOLDER)
        if session:
            os.environ[stage_server.FOLDER] = session
        for pid in folder.glob("*.pid"):
            os.kill(int(pid.read_text()), signal.SIGTERM)


def start(cwd: Path, *argv: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "stages.probe", *argv]
    env = {**os.environ, "PIPELINE_RUN_NAME": str(cwd)}  # read after the imports: not in the key
    return subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def probe(cwd: Path, *argv: str) -> tuple[dict, str, int]:
    process = start(cwd, *argv)
    out, err = process.communicate(f"input of {cwd.name}\n", timeout=120)
    return json.loads(out.splitlines()[-1]), err, process.returncode


def test_a_forked_stage_sees_what_a_fresh_one_sees(served, monkeypatch):
    folder, first, second = served
    monkeypatch.delenv(stage_server.FOLDER)
    fresh, err, code = probe(first, "run", "3")
    assert not fresh["torch_imported"] and (err, code) == ("input of first\n", 3)
    monkeypatch.setenv(stage_server.FOLDER, str(folder))
    forked, err, code = probe(second, "run", "5", "--flag=x")  # another copy of the project: the same key
    assert forked["torch_imported"], "forked from the server, which imported torch"
    assert (err, code) == ("input of second\n", 5)
    assert forked["argv"] == ["run", "5", "--flag=x"] and forked["cwd"] == str(second)
    assert forked["setting"] == str(second), "the request's environment"
    assert forked["atomic"] == str(second / "pipeline" / "core" / "atomic.py"), "our modules from its own folder"
    (log,) = folder.glob("*.log")
    assert f"{forked['pid']} forked, -m stages.probe run 5 --flag=x" in log.read_text()


def test_signals_reach_a_forked_stage_and_it_ends_with_the_process_dvc_started(served):
    _, first, _ = served
    stage = start(first, "sleep", "0")
    stage.stdin.close()
    forked = json.loads(stage.stdout.readline())
    assert forked["torch_imported"] and forked["pid"] != stage.pid and forked["pgid"] == os.getpgrp()
    stage.send_signal(signal.SIGTERM)
    assert stage.wait(timeout=30) == -signal.SIGTERM, "ended by the signal, as the fresh stage would be"
    stage = start(first, "sleep", "0")
    stage.stdin.close()
    os.kill(json.loads(stage.stdout.readline())["pid"], signal.SIGKILL)  # the stage itself killed (out of memory)
    assert stage.wait(timeout=30) == -signal.SIGKILL
    stage = start(first, "sleep", "0")
    stage.stdin.close()
    forked = json.loads(stage.stdout.readline())
    stage.kill()  # no signal to pass on: the server's monitor sees it go
    stage.wait()
    deadline = time.monotonic() + 30
    while alive(forked["pid"]):
        assert time.monotonic() < deadline, "the forked stage outlived the process that asked for it"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return b"zombie" not in Path(f"/proc/{pid}/status").read_bytes()
    except FileNotFoundError:
        return False


def test_a_stage_that_needs_what_the_server_hid_starts_fresh(served):
    folder, first, _ = served
    again, err, code = probe(first, "needs-bitsandbytes", "4")
    assert not again["torch_imported"] and (err, code) == ("input of first\n", 4)
    (log,) = folder.glob("*.log")
    assert f"{again['pid']} forked, -m stages.probe needs-bitsandbytes" in log.read_text(), "forked, then fresh"
