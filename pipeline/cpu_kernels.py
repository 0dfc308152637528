"""Our C++ kernels for CPUs (cpu_kernels.cpp: the attention's softmax and its gradient, the loss's softmax
cross-entropy over a vocabulary row), compiled once per environment (`make setup`, or the first use) with
-march=native into the environment's extensions folder, and imported from there by every process after (0.3 ms).
Plain loops the compiler vectorizes; the exp is a polynomial within 2 ulp."""

from __future__ import annotations

import hashlib
import importlib.util
import platform
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


def library_name() -> str:
    """The build's name, from what it depends on: the source, the flags, torch, and this CPU (-march=native)."""
    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu += next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), cpu.encode()]
    return "cpu_kernels_" + hashlib.sha256(bytes(1).join(parts)).hexdigest()[:16]


@cache
def load():
    """The compiled kernels, imported from the environment's extensions folder, and compiled there first when
    missing (about 20 s; concurrent builders wait for one). None where they cannot be built."""
    from pipeline.processes import extensions_dir

    name = library_name()
    folder = extensions_dir() / name
    library = folder / f"{name}.so"
    if library.exists():
        try:
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except (ImportError, OSError):  # still being written by another process's build: wait for it below
            pass
    from torch.utils.cpp_extension import load as build

    folder.mkdir(parents=True, exist_ok=True)
    try:
        return build(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, build_directory=str(folder))
    except (RuntimeError, OSError, ImportError):
        return None
