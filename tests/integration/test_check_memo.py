"""The check stage reads an input file once: an unchanged file (same size and modification time) is not read again
on the next run, and a changed one is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from pipeline.core import config
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def check(tmp_path, params):
    command = [
        sys.executable, "-m", "stages.check", "--params", str(params), "--produced", "data/corpus", "artifacts",
        "--out", str(tmp_path / "checked.json"), "--memo", str(tmp_path / "memo.json"),
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True)


def test_an_unchanged_input_is_not_read_again_and_a_changed_one_is(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("第一段。\n\n第二段。\n", encoding="utf-8")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose(REPO / "conf", [f"data.train_file={corpus}"])))
    assert check(tmp_path, params).returncode == 0
    stat = corpus.stat()
    corpus.write_bytes(b"\xff" * stat.st_size)  # not UTF-8: refused when read
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert check(tmp_path, params).returncode == 0, "same size and time: taken as verified, not read"
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    done = check(tmp_path, params)
    assert done.returncode == 2 and "data.train_file" in done.stderr and str(corpus) in done.stderr
