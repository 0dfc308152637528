"""pipeline/core/imports.py with core/deepspeed_patches.imported in a fresh interpreter: DeepSpeed comes without
MLflow, its Muon functions DeepSpeed's own uncompiled ones and no inductor, and MLflow and the absence of bitsandbytes
and scipy behave as the train ranks need (MLflow importable afterwards; bitsandbytes and scipy invisible to find_spec,
as PEFT and transformers look for them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib.util, json, sys, types
from pipeline.core import deepspeed_patches, imports
imports.without_unused()
deepspeed_patches.imported()
after = {name: name in sys.modules for name in ("mlflow", deepspeed_patches.MUON, "torch._inductor.compile_fx")}
from deepspeed.runtime.zero.muon import original_muon
after["muon_eager"] = all(type(f) is types.FunctionType and f.__module__ == original_muon.__name__
                          for f in (original_muon.muon_update, original_muon.zeropower_via_newtonschulz5))
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
        "muon_eager": True,  # DeepSpeed's own functions, not torch.compile's wrappers of them
        "mlflow_usable": True,
        "bitsandbytes_found": False,
        "scipy_found": False,
        "bitsandbytes_imported": False,
        "scipy_imported": False,
    }
