"""pipeline/core/deepspeed_patches.py: the ZeRO-3 patches train the very tensors of stock DeepSpeed (one rank, every
tensor partitioned); on a DeepSpeed they were not written for, every patch is left off with one warning and the run
trains stock DeepSpeed's tensors; zero.Init keeps the dtype it is given; no shared-memory all-reduce; py-cpuinfo asked
once. The fused ZeRO-1/2 tail: tests/integration/test_zero_tail.py; the fetch and release under compiled layers:
tests/unit/kernels/test_compiled_layers.py; Muon uncompiled: tests/unit/core/test_imports.py."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from pipeline.core import deepspeed_patches
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

ZERO3 = ("zero3_lists", "zero3_fetch", "zero3_release", "zero3_flags")


def test_zero3_patches_train_the_very_tensors_of_stock_deepspeed(tmp_path):
    """One rank over gloo in a process of its own (tests/helpers/zero3_patches_worker.py): a head that reads the
    embedding's weight, every tensor partitioned, three steps. With every ZeRO-3 patch, DeepSpeed never walks the
    modules, every parameter dict is flagged inside each forward and none after it, and the steps train the very
    tensors of stock DeepSpeed (the head's product needs the gathered weight: an unflagged dict would leave it empty);
    on a DeepSpeed the patches were not written for, none is installed and the tensors are stock DeepSpeed's too."""
    command = [sys.executable, "-m", "tests.helpers.zero3_patches_worker", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=with_venv_path(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["patched"]["installed"] == [{"zero_tail": 0, **dict.fromkeys(ZERO3, 1)}]
    assert seen["other_version"]["installed"] == [dict.fromkeys(["zero_tail", *ZERO3], 0)] * 2
    assert seen["deepspeed"]["deepspeed_walks"] >= 3 * 5 and seen["patched"]["deepspeed_walks"] == 0, seen
    assert seen["other_version"]["deepspeed_walks"] == seen["deepspeed"]["deepspeed_walks"], seen
    for run in seen.values():
        assert run["flagged_inside"] == [True] * 3 and run["flagged_after"] == [False] * 3, seen
    warned = [line for line in done.stderr.splitlines() if "left off" in line]
    assert len(warned) == len(ZERO3) and all("DeepSpeed 0.19.8, found 0.20.0" in line for line in warned), warned
    theirs = load_file(tmp_path / "deepspeed.safetensors")
    assert "embedding.weight" in theirs
    for run in ("other_version", "patched"):
        ours = load_file(tmp_path / f"{run}.safetensors")
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():
            torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=f"{run}: {name}")


OTHER_VERSION = """
import json, sys, types
import deepspeed
deepspeed.__version__ = "0.20.0"
from pipeline.core import deepspeed_patches
for _ in range(2):
    deepspeed = deepspeed_patches.imported()
import cpuinfo, deepspeed.ops
from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)  # ZeRO-1/2's, as zero_tail takes it
optimizer.cpu_offload = optimizer.has_moe_layers = False
optimizer.model_parallel_world_size = 1
zero1 = types.SimpleNamespace(optimizer=optimizer)
zero3 = types.SimpleNamespace(zero_optimization_stage=lambda: 3)
installed = [patch(zero1 if name == "zero_tail" else zero3) for name, patch in deepspeed_patches.ENGINE.items()]
installed += [patch(zero1 if name == "zero_tail" else zero3) for name, patch in deepspeed_patches.ENGINE.items()]
coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
print(json.dumps({
    "installed": installed,
    "muon_imported": deepspeed_patches.MUON in sys.modules,
    "init_patched": hasattr(partition_parameters.Init._set_dtype, "keeps_dtype"),
    "shm_refused": "__compatible_ops__" in vars(deepspeed.ops),
    "cpuinfo_cached": hasattr(cpuinfo.get_cpu_info, "cache_info"),
    "tail_patched": "check_overflow" in vars(optimizer),
    "lists_patched": hasattr(partitioned_param_coordinator.iter_params, "kept"),
    "fetch_patched": hasattr(partition_parameters._no_gather_coalesced, "on_device"),
    "release_patched": hasattr(getattr(coordinator, deepspeed_patches.RELEASE), "direct"),
}))
"""


def test_on_another_deepspeed_every_patch_is_left_off_with_one_warning():
    """In a fresh interpreter told the patches were written for another DeepSpeed: DeepSpeed imported twice and every
    engine patch tried twice leave every DeepSpeed function as DeepSpeed wrote it, with one warning a patch naming
    both versions (the engine patches on a real engine: the test above)."""
    done = subprocess.run([sys.executable, "-c", OTHER_VERSION], cwd=REPO, capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen.pop("installed") == [False] * 10
    assert not any(seen.values()), seen
    warned = [line for line in done.stderr.splitlines() if "left off" in line]
    patches = ["muon_uncompiled", "zero_init_keeps_dtype", "without_shm_all_reduce", "cpu_info_once"]
    assert [line.split()[1] for line in warned] == [*patches, *deepspeed_patches.ENGINE], warned
    assert all("written for DeepSpeed 0.19.8, found 0.20.0" in line for line in warned), warned


def test_zero_init_keeps_the_dtype_it_is_given_without_fp16(monkeypatch):
    deepspeed_patches.imported()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import Init

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)  # as on AMD's CPUs
    init = Init.__new__(Init)
    for dtype in (torch.float32, torch.bfloat16):
        Init._set_dtype(init, None, dtype)  # an explicit dtype: DeepSpeed 0.19.8 alone gives bf16 for fp32
        assert init.dtype == dtype


def test_init_distributed_leaves_out_the_shared_memory_all_reduce():
    """A CPU rank's DeepSpeed backend builds no shared-memory op (nor its /dev/shm buffer); its all-reduce is gloo's."""
    deepspeed_patches.imported()
    from deepspeed.comm.torch import build_shm_op

    assert build_shm_op() is None


def test_py_cpuinfo_answers_once(monkeypatch):
    import cpuinfo

    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"vendor_id_raw": "AuthenticAMD"})
    deepspeed_patches.cpu_info_once()
    assert cpuinfo.get_cpu_info() is cpuinfo.get_cpu_info() and calls == [1]
