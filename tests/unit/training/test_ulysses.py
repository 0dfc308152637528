"""Sequence parallelism's model side (pipeline.training.ulysses) on 2 and 4 CPU processes over gloo: every kind of
micro-batch the loop builds gives the unsplit model's loss, and the group's gradients sum to the unsplit ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.core.environment import free_port, with_venv_path
from tests.conftest import REPO

pytestmark = pytest.mark.integration  # processes over gloo

CASES = {"blocks", "packed_sft", "labels_on_one_shard", "one_long_row", "logits", "dpo_padded_pairs",
         "orpo_padded_pairs"}  # fmt: skip


def run_group(size: int, out) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(size):
        env = {**with_venv_path(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [
            sys.executable,
            "-m",
            "tests.helpers.sequence_parallel_worker",
            "--size",
            str(size),
            "--out",
            str(out),
        ]
        procs.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_sequence_trains_as_the_whole(tmp_path, size):
    results = run_group(size, tmp_path / "results.json")
    assert {r["case"] for r in results} == CASES and {r["kernels"] for r in results} == {"off", "auto"}
    for r in results:
        assert abs(r["loss"] - r["expected_loss"]) < 1e-5 * max(1.0, abs(r["expected_loss"])), r
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]) and r["grad_scale"] > 0, r
        assert r["extra_diff"] < 1e-4, r
    tokens = {r["case"]: r["shard_tokens"] for r in results if r["kernels"] == "off"}
    assert tokens["blocks"] == [48 // size] and tokens["packed_sft"] == [-(-25 // size)], tokens
    assert tokens["dpo_padded_pairs"] == [-(-4 * 13 // size)], tokens  # 2 pairs: 4 rows padded to 13
