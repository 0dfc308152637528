"""Our C++ for CPUs, compiled once per environment (`make setup`, or the first use) with -march=native into the
environment's extensions folder and imported from there by every process after: the kernels of
csrc/kernels.cpp (the attention's softmax and its gradient, the loss's softmax cross-entropy over a vocabulary row,
SwiGLU's product, RMSNorm: plain loops the compiler vectorizes, the exp a polynomial within 2 ulp), and any other
source given to `build` (pipeline/kernels/csrc/allocator.cpp)."""

from __future__ import annotations

import hashlib
import importlib.util
import platform
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


def library_name(source: Path = SOURCE) -> str:
    """The build's name, from what it depends on: the source, the flags, torch, and this CPU (-march=native)."""
    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu += next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    parts = [source.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), cpu.encode()]
    return f"{source.stem}_" + hashlib.sha256(bytes(1).join(parts)).hexdigest()[:16]


def load():
    """The compiled kernels of csrc/kernels.cpp (see `build`)."""
    return build(SOURCE)


@cache
def build(source: Path):
    """The compiled `source`, imported from the environment's extensions folder, and compiled there first when
    missing (concurrent builders wait for one). None where it cannot be built."""
    from pipeline.core.environment import extensions_dir

    name = library_name(source)
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
    from torch.utils.cpp_extension import load as compile_extension

    folder.mkdir(parents=True, exist_ok=True)
    try:
        return compile_extension(name=name, sources=[str(source)], extra_cflags=FLAGS, build_directory=str(folder))
    except (RuntimeError, OSError, ImportError):
        return None
