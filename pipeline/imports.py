"""DeepSpeed, PEFT and transformers imported without the optional packages they import whenever those are installed
but a run does not use: DeepSpeed's autotuner imports MLflow (0.8 s and 50 MB in every rank), PEFT and transformers
import bitsandbytes (0.5 s and 40 MB) for a base that is not quantized. A None entry in sys.modules is Python's own
"not importable": importing it raises ImportError and importlib.util.find_spec finds nothing, which is how these
packages test for their optional dependencies."""

from __future__ import annotations

import sys
from types import ModuleType


def deepspeed() -> ModuleType:
    """DeepSpeed, imported (the first time) with MLflow absent; MLflow stays importable afterwards (our tracking
    imports it when a run logs; DeepSpeed's autotuner, which we never run, is left without it)."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None
        try:
            import deepspeed as loaded
        finally:
            del sys.modules["mlflow"]
        return loaded
    import deepspeed as loaded

    return loaded


def without_bitsandbytes() -> None:
    """Make bitsandbytes absent for the rest of this process (a run without a quantized base); call it before PEFT
    or transformers are imported."""
    sys.modules.setdefault("bitsandbytes", None)
