"""A rank server's key is what a rank's imports read (the sources' contents, not the project folder they are in, nor
DVC's or a sweep's variables), and a rank it forks imports from its own request's folder, as a fresh rank would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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
