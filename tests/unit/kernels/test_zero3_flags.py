"""kernels/zero3_flags.py: ZeRO-3's forward flags set through a list of the modules' parameter dicts read once."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from pipeline.core.environment import with_venv_path
from tests.conftest import REPO


def test_listed_flags_gather_an_outside_parameter_as_deepspeed_s_walk_does(tmp_path):
    """One rank over gloo in a process of its own (tests/helpers/zero3_flags_worker.py): a head that reads the
    embedding's weight, every tensor partitioned. With the flags set through the list, DeepSpeed never walks the
    modules, every parameter dict is flagged inside each forward and none after it, and the three steps train the
    very tensors DeepSpeed's own flags train (the head's product needs the gathered weight: an unflagged dict would
    leave it empty)."""
    command = [sys.executable, "-m", "tests.helpers.zero3_flags_worker", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["deepspeed"]["deepspeed_walks"] >= 3 * 5 and seen["listed"]["deepspeed_walks"] == 0, seen
    for run in seen.values():
        assert run["flagged_inside"] == [True] * 3 and run["flagged_after"] == [False] * 3, seen
    theirs, ours = load_file(tmp_path / "deepspeed.safetensors"), load_file(tmp_path / "listed.safetensors")
    assert theirs.keys() == ours.keys() and "embedding.weight" in theirs
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=name)
