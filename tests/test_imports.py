"""pipeline/imports.py in a fresh interpreter: DeepSpeed comes without MLflow, Muon and inductor, and MLflow and
bitsandbytes' absence behave as the train ranks need (MLflow importable afterwards; bitsandbytes invisible to
find_spec, as PEFT and transformers look for it)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib.util, json, sys
from pipeline import imports
imports.without_bitsandbytes()
imports.deepspeed()
after = {name: name in sys.modules for name in ("mlflow", imports.MUON, "torch._inductor.compile_fx")}
import mlflow
import peft
print(json.dumps({**after, "mlflow_usable": hasattr(mlflow, "MlflowClient"),
                  "bitsandbytes_found": importlib.util.find_spec("bitsandbytes") is not None,
                  "peft_imported_bitsandbytes": sys.modules.get("bitsandbytes") is not None}))
"""


def test_deepspeed_without_mlflow_or_inductor_and_peft_without_bitsandbytes():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "mlflow": False,
        "deepspeed.runtime.zero.muon.muon_optimizer": True,  # imported, but uncompiled
        "torch._inductor.compile_fx": False,
        "mlflow_usable": True,
        "bitsandbytes_found": False,
        "peft_imported_bitsandbytes": False,
    }
