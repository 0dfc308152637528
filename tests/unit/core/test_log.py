"""One logger: `name: message` lines, progress on stdout and warnings on stderr, on global rank 0 only (a process
that is no rank counts as rank 0)."""

from __future__ import annotations

import subprocess
import sys

from pipeline.core.log import logger
from tests.conftest import REPO


def test_lines_carry_the_name_and_warnings_go_to_stderr(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    logger("train").info("resuming from step_000003 (100% of it)")
    logger("tracking").warning("cannot open a run; going on without MLflow")
    out, err = capsys.readouterr()
    assert out == "train: resuming from step_000003 (100% of it)\n"
    assert err == "tracking: cannot open a run; going on without MLflow\n"


def test_only_global_rank_0_writes(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger("train").info("from rank 1")
    logger("train").warning("from rank 1")
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    logger("train").info("from rank 0")
    assert capsys.readouterr().out == "train: from rank 0\n"


def test_lines_of_a_process_arrive_whole_and_in_order_before_it_ends():
    code = "from pipeline.core.log import logger\nfor i in range(3): logger('stage').info(f'line {i}')\n"
    code += "import os; os._exit(0)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env={"RANK": "0"})
    assert done.stdout == "stage: line 0\nstage: line 1\nstage: line 2\n", "flushed before os._exit (as ranks end)"
