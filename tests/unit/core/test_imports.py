"""pipeline/core/imports.py in a fresh interpreter: DeepSpeed comes without MLflow, Muon and inductor, and MLflow and
the absence of bitsandbytes and scipy behave as the train ranks need (MLflow importable afterwards; bitsandbytes and
scipy invisible to find_spec, as PEFT and transformers look for them); zero.Init keeps the dtype it is given on an
accelerator without fp16."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline.core import imports

PROBE = """
import importlib.util, json, sys
from pipeline.core import imports
imports.without_unused()
imports.deepspeed()
after = {name: name in sys.modules for name in ("mlflow", imports.MUON, "torch._inductor.compile_fx")}
import mlflow
import peft
import transformers.modeling_utils  # imports its losses, and scipy where it finds it
print(json.dumps({**after, "mlflow_usable": hasattr(mlflow, "MlflowClient"),
                  **{f"{name}_found": importlib.util.find_spec(name) is not None for name in imports.UNUSED},
                  **{f"{name}_imported": sys.modules.get(name) is not None for name in imports.UNUSED}}))
"""


@pytest.mark.slow
def test_deepspeed_without_mlflow_or_inductor_and_peft_without_bitsandbytes_or_scipy():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "mlflow": False,
        "deepspeed.runtime.zero.muon.muon_optimizer": True,  # imported, but uncompiled
        "torch._inductor.compile_fx": False,
        "mlflow_usable": True,
        "bitsandbytes_found": False,
        "scipy_found": False,
        "bitsandbytes_imported": False,
        "scipy_imported": False,
    }


def test_zero_init_keeps_the_dtype_it_is_given_without_fp16(monkeypatch):
    imports.deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import Init

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)  # as on AMD's CPUs
    init = Init.__new__(Init)
    for dtype in (torch.float32, torch.bfloat16):
        Init._set_dtype(init, None, dtype)  # an explicit dtype: DeepSpeed 0.19.8 alone gives bf16 for fp32
        assert init.dtype == dtype


def test_init_distributed_leaves_out_the_shared_memory_all_reduce():
    """A CPU rank's DeepSpeed backend builds no shared-memory op (nor its /dev/shm buffer); its all-reduce is gloo's."""
    imports.deepspeed()
    from deepspeed.comm.torch import build_shm_op

    assert build_shm_op() is None
