"""Checkpoint pickles read as data, never as code: one allowlist for every `.pt`/`.bin` file another tool or person
wrote (DeepSpeed's model and optimizer states, RNG states, universal checkpoints).

A pickle names the functions and classes it calls while loading (its globals). Only these are let through:
tensors and storages being rebuilt, plain containers, numpy arrays and scalars (RNG states), argparse's Namespace
(DeepSpeed-Chat's arguments), and DeepSpeed's own classes, which are never imported: its enums become ints and every
other class an inert stand-in holding its fields. Anything else is refused, naming the file and the global, before
it runs; `trust=True` (`--trust-pickles` of the CLI commands, for a user's own files) lifts the check.

`scan` reads a file's globals without unpickling it (the opcodes of torch's zip format); `load` unpickles through
the allowlist."""

from __future__ import annotations

import contextvars
import io
import pickle
import pickletools
import types
import zipfile
from pathlib import Path

ALLOWED = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"), ("_codecs", "encode"),
    ("argparse", "Namespace"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch.nn.parameter", "Parameter"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}  # fmt: skip
ALLOWED_PREFIXES = ("deepspeed.",)  # replaced by stand-ins, never imported
TRUSTED = contextvars.ContextVar("trust_pickles", default=False)  # --trust-pickles of the CLI commands
HINT = (
    "it is not data a checkpoint writer we support stores, and unpickling it could run code; if the file is your own, "
    "pass --trust-pickles (python -m pipeline consolidate|convert), or save its tensors again as safetensors"
)


class UnsafePickle(ValueError):
    """A pickle that names a global outside the allowlist."""


def allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED or module.startswith(ALLOWED_PREFIXES):
        return True
    torch_type = module == "torch" and (name.endswith("Storage") or name in ("float32", "bfloat16", "float16"))
    return torch_type or (module.startswith("numpy") and module.endswith("dtypes") and name.endswith("DType"))


def refusal(path: Path, module: str, name: str) -> UnsafePickle:
    return UnsafePickle(f"{path}: refused: its pickle names {module}.{name}; {HINT}")


class _Opaque:
    """Stands in for a DeepSpeed object inside a checkpoint (a loss scaler, a fragment address): its fields only."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {})


def unpickler(path: Path, *, trust: bool = False) -> types.SimpleNamespace:
    """A pickle module for torch.load whose Unpickler lets through the allowlist only (all but DeepSpeed's stand-ins
    with `trust`)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module.split(".")[0] == "deepspeed":
                return int if name.endswith("Enum") else _Opaque
            if not trust and not allowed(module, name):
                raise refusal(path, module, name)
            return super().find_class(module, name)

    return types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pipeline_checkpoint_pickle")


def load(path: Path, *, trust: bool = False) -> object:
    """torch.load of `path` through the allowlist (memory-mapped where the file's format allows); `trust` or
    TRUSTED lifts it."""
    from pipeline.checkpoints.mapped import torch_load

    return torch_load(path, weights_only=False, pickle_module=unpickler(path, trust=trust or TRUSTED.get()))


def globals_of(data: bytes) -> list[tuple[str, str]]:
    """The globals a pickle names, from its opcodes alone; a global whose name is not a plain string pushed just
    before it (built on the stack) is returned as ("?", "a computed name")."""
    found, pushed = [], []  # pushed: the strings pushed so far, None for anything else pushed
    for opcode, argument, _ in pickletools.genops(io.BytesIO(data)):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            pushed.append(argument)
        elif opcode.name == "GLOBAL":
            module, _, name = argument.partition(" ")
            found.append((module, name))
        elif opcode.name == "STACK_GLOBAL":
            named = len(pushed) >= 2 and None not in pushed[-2:]
            found.append((pushed[-2], pushed[-1]) if named else ("?", "a computed name"))
        elif opcode.name not in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            pushed.append(None)
    return found


def scan(path: Path, *, trust: bool = False) -> None:
    """Refuse `path` (a torch file) if its pickle names a global outside the allowlist, without unpickling it;
    torch's legacy format (not a zip) is unpickled through the allowlist instead."""
    if trust or TRUSTED.get():
        return
    if not zipfile.is_zipfile(path):
        load(path)
        return
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith(".pkl"):
                for module, name in globals_of(archive.read(member)):
                    if not allowed(module, name):
                        raise refusal(path, module, name)


def scan_folder(folder: Path, *, trust: bool = False) -> None:
    """`scan` every torch file under `folder` (a universal checkpoint: a folder of files per parameter)."""
    for path in sorted(Path(folder).rglob("*.pt")):
        scan(path, trust=trust)
