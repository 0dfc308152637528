"""`make scale-check` cannot rot: its smoke mode runs the same path (every stage `dvc repro` runs, in its order, each
measured) on a tiny random LLaMA, and writes the check's table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_scale_check_smoke_runs_every_stage(tmp_path):
    command = [sys.executable, "-m", "bench.scale_check", "--smoke", "--workdir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = read_json(tmp_path / "project" / "metrics" / "scale_check.json")
    ran = [row["stage"] for row in result["stages"]]
    stages = {"check", "prepare_base_tokenizer", "prepare_base", "cache_dataset", "train", "consolidate", "merge"}
    assert stages | {"evaluate", "track"} <= set(ran)
    assert [s for s in ran if s.startswith("eval_set@")], "the held-out sets evaluate reads are prepared first"
    assert ran.index("evaluate") > max(ran.index(s) for s in ran if s.startswith("eval_set@"))
    assert all(row["peak_memory_mb"] > 0 for row in result["stages"])
    assert result["train_zero3_partitioned"][0] == result["train_zero3_partitioned"][1]
    assert result["old_loading_path"] == {"skipped": "--smoke"}
    assert result["corpus_mb"] >= 8 and result["dataset"]["tokens"] > 4_000_000, "the generated corpus was trained on"
