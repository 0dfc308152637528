"""Loaded by every Python process started with this folder first on PYTHONPATH (the DeepSpeed launcher passes
PYTHON* variables to its ranks): any unpickling outside the restricted loader raises, and is written down.

- torch.load is allowed only as the checkpoint loader (pipeline/checkpoints/safe_pickle.py) calls it, with
  weights_only=True; every such load is logged with its file, anything else is a violation (DeepSpeed's own
  torch.load with weights_only=False, transformers' or PEFT's torch.load, any other);
- Python's unpickler reading a file (pickle.load, pickle.Unpickler on a file, numpy's np.load) is a violation;
  inside a torch.load any use of Python's unpickler is.
The log folder ($UNPICKLING_GUARD_LOG) gets one `loads-PID` file per process (its argv first, then each file loaded)
and a `violations-PID` file for each process that tried anything else."""

import importlib.abc
import importlib.util
import io
import os
import pickle
import sys
import threading
import traceback

LOG = os.environ["UNPICKLING_GUARD_LOG"]
LOADER = "pipeline.checkpoints.safe_pickle"  # the one module that may call torch.load
_inside = threading.local()


def _write(kind: str, line: str) -> None:
    with open(os.path.join(LOG, f"{kind}-{os.getpid()}"), "a", encoding="utf-8") as out:
        out.write(line.replace("\n", " | ") + "\n")


def _violation(what: str) -> None:
    _write("violations", f"{what} from {''.join(traceback.format_stack(limit=12))}")
    raise RuntimeError(f"unpickling guard: {what} (only the restricted checkpoint loader may unpickle)")


_write("loads", "argv " + " ".join(sys.argv))
_pickle_load, _pickle_loads, _Unpickler = pickle.load, pickle.loads, pickle.Unpickler


class _GuardedUnpickler(_Unpickler):
    def __init__(self, file, *args, **kwargs):
        if getattr(_inside, "torch_load", False) or not isinstance(file, io.BytesIO):
            _violation(f"Python's Unpickler over {type(file).__name__}")
        super().__init__(file, *args, **kwargs)


def _guarded_load(file, *args, **kwargs):
    _violation(f"pickle.load of {getattr(file, 'name', type(file).__name__)}")


def _guarded_loads(data, *args, **kwargs):
    if getattr(_inside, "torch_load", False):
        _violation("pickle.loads inside torch.load")
    return _pickle_loads(data, *args, **kwargs)


pickle.Unpickler, pickle.load, pickle.loads = _GuardedUnpickler, _guarded_load, _guarded_loads


def _guard_torch(torch) -> None:
    original = torch.load

    def load(f, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller != LOADER or kwargs.get("weights_only") is not True:
            _violation(f"torch.load({f!r}, weights_only={kwargs.get('weights_only')}) from {caller}, not the loader")
        _write("loads", f"restricted {f}")
        _inside.torch_load = True
        try:
            return original(f, *args, **kwargs)
        finally:
            _inside.torch_load = False

    torch.load = torch.serialization.load = load


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Wraps torch.load as soon as torch is imported (importing it here would slow every process down)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _guard_torch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())
