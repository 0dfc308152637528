"""The fused step tail of ZeRO-1/2 (`deepspeed_patches.zero_tail`) on 2 CPU ranks over gloo: the clipping norm
DeepSpeed computes tensor by tensor, within 1e-6 (relative), in fp32 and bf16; an inf in one gradient element of one
rank skips the step on every rank, as DeepSpeed's own check does; and the train stage with the tail trains what it
trains with DeepSpeed's step (`train.kernels_skip=[zero_tail]`), within fp32 rounding."""

from __future__ import annotations

import subprocess

import pytest

from pipeline.core.atomic import read_json
from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.ops import remove_stale_shm_buffers
from tests.conftest import REPO
from tests.helpers.training import TINY, TWO_RANKS, assert_same_training, train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero_tail")
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module"]
    command += ["tests.helpers.zero_tail_worker", "--out", str(out)]
    env = {**with_venv_path(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    remove_stale_shm_buffers()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [read_json(out / f"rank{r}.json") for r in (0, 1)]


def test_the_fused_norm_is_deepspeeds(ranks):
    for results in ranks:
        for name, case in results.items():
            assert case["stock_norm"] > 0.5, (name, case)  # above max_grad_norm: clipping acts
            assert abs(case["fused_norm"] - case["stock_norm"]) <= 1e-6 * case["stock_norm"], (name, case)
    for name in ranks[0]:  # the norm is all-reduced: both ranks clip by the same factor
        assert ranks[0][name]["fused_norm"] == ranks[1][name]["fused_norm"], name


def test_an_inf_on_one_rank_skips_the_step_everywhere(ranks):
    for results in ranks:
        for name, case in results.items():
            assert case["first_step_moved"], name
            assert case["inf_skipped"], name  # fused and stock alike


def test_the_stage_trains_with_the_tail_as_with_deepspeeds_step(tmp_path, inputs, tiny_base_dir, two_ranks_zero2):
    train(inputs, tiny_base_dir, tmp_path, [*TINY, *TWO_RANKS, "deepspeed=zero2", "train.kernels_skip=[zero_tail]"])
    assert read_json(two_ranks_zero2 / "metrics.json")["kernels"]["zero_tail"] == 1
    assert "zero_tail" not in read_json(tmp_path / "metrics.json")["kernels"]
    assert_same_training(tmp_path, two_ranks_zero2, atol=1e-6)
