"""The architecture matrix under ZeRO-3: 2 ranks build each model partitioned, each reading only its own slice of
every parameter (converted ones, such as fused MoE experts, through transformers' own conversions), and the gathered
model is `AutoModelForCausalLM.from_pretrained`'s, tensor for tensor, its grown embedding rows the mean of the old."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.ops import remove_stale_shm_buffers
from tests.conftest import REPO
from tests.helpers.architectures import MATRIX

pytestmark = pytest.mark.integration
GROW = 5


@pytest.fixture(scope="module")
def partitioned(architecture_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("partitioned")
    command = [
        "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
        "--module", "tests.helpers.architecture_load_worker", "--out", str(out), "--grow", str(GROW),
        "--models", *(str(architecture_dirs[name]) for name in MATRIX),
    ]  # fmt: skip
    env = {**with_venv_path(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    remove_stale_shm_buffers()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", list(MATRIX))
def test_the_partitioned_base_is_transformers_own(name, architecture_dirs, partitioned):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(architecture_dirs[name], dtype=torch.float32)
    rows = reference.config.vocab_size
    expected = dict(reference.named_parameters())
    got = load_file(partitioned / f"{name}.safetensors")
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if got[key].shape[0] == rows + GROW and value.shape[0] == rows:
            assert torch.equal(got[key][:rows], value), key
            assert torch.allclose(got[key][rows:], value.double().mean(0).float().expand(GROW, -1)), key
        else:
            assert torch.equal(got[key], value), key
