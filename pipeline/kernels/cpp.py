"""Our C++ for CPUs, compiled once per environment (`make setup`, or the first use) with -march=native into the
environment's extensions folder and imported from there by every process after: the kernels of
csrc/kernels.cpp (the attention's softmax and its gradient, the loss's softmax cross-entropy over a vocabulary row,
SwiGLU's product, RMSNorm: plain loops the compiler vectorizes, the exp a polynomial within 2 ulp), and any other
source given to `build` (pipeline/kernels/csrc/allocator.cpp).

The code path is the compiler's: the vector width its reductions sum over and whether a * b + c is one fused
operation follow the CPU's features. `PIPELINE_KERNELS_ISA` builds another CPU's path on this one, into a folder of
its own (tests force it; docs/cpu_paths.md): `native` (the default), `avx512` (16 lanes), `avx2` (8 lanes, FMA) or
`scalar` (one element at a time, no FMA)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
from functools import cache
from pathlib import Path

from pipeline.core.imports import torch

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
ISA_VARIABLE = "PIPELINE_KERNELS_ISA"
X86 = platform.machine() in ("x86_64", "AMD64")
TARGETS = {  # the compiler's flags for each path; all but native are x86-64 levels (scalar: any machine)
    "native": ["-march=native", "-fopenmp-simd"],
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512", "-fopenmp-simd"],
    "avx2": ["-march=x86-64-v3", "-fopenmp-simd"],
    "scalar": ["-march=x86-64", "-fno-tree-vectorize"] if X86 else ["-fno-tree-vectorize"],
}
NEEDS = {  # the CPU flags (/proc/cpuinfo) a forced path's instructions need
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx2": {"avx2", "fma", "bmi2", "f16c", "movbe"},
}


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none), read once a process: a
    rank's layers ask for their kernels at every call, and /proc/cpuinfo of a many-core node is long to read."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def unrunnable(isa: str) -> str | None:
    """Why this CPU cannot run the path `isa` (None where it can)."""
    if isa in NEEDS and not X86:
        return f"an x86-64 path; this machine is {platform.machine()}"
    missing = NEEDS[isa] - cpu_flags() if isa in NEEDS else set()
    return f"this CPU lacks {', '.join(sorted(missing))}" if missing else None


def runnable() -> tuple[str, ...]:
    """The paths this CPU can run: every one a test can force here."""
    return tuple(isa for isa in TARGETS if unrunnable(isa) is None)


def target() -> str:
    """The path `PIPELINE_KERNELS_ISA` asks for (native where unset); a ValueError for one this CPU cannot run."""
    isa = os.environ.get(ISA_VARIABLE) or "native"
    if isa not in TARGETS:
        raise ValueError(f"{ISA_VARIABLE}={isa!r}; expected one of {', '.join(TARGETS)}")
    if (why := unrunnable(isa)) is not None:
        raise ValueError(f"{ISA_VARIABLE}={isa}: {why}")
    return isa


def flags(isa: str) -> list[str]:
    """The compiler's flags for the path `isa`."""
    return ["-O3", *TARGETS[isa]]


def library_name(source: Path = SOURCE, isa: str = "native") -> str:
    """The build's name, from what it depends on: the source, the flags, torch, and this CPU (-march=native)."""
    cpu = platform.machine() + " ".join(sorted(cpu_flags()))
    parts = [source.read_bytes(), " ".join(flags(isa)).encode(), torch.__version__.encode(), cpu.encode()]
    return f"{source.stem}_" + hashlib.sha256(bytes(1).join(parts)).hexdigest()[:16]


def load(isa: str | None = None):
    """The compiled kernels of csrc/kernels.cpp on the path `isa` (default: `target()`; see `build`)."""
    return build(SOURCE, isa or target())


def path() -> str:
    """The kernels' path in this process, as the metrics and the test header name it: the target and what the
    compiler built it for ("native (avx512+fma)"), or that it could not be built."""
    isa = target()
    compiled = load(isa)
    return f"{isa} ({compiled.isa()})" if compiled is not None else f"{isa} (not built)"


@cache
def build(source: Path, isa: str = "native"):
    """The compiled `source` for the path `isa`, imported from the environment's extensions folder, and compiled
    there first when missing (concurrent builders wait for one). None where it cannot be built."""
    from pipeline.core.environment import extensions_dir

    name = library_name(source, isa)
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
        return compile_extension(name=name, sources=[str(source)], extra_cflags=flags(isa), build_directory=str(folder))
    except (RuntimeError, OSError, ImportError):
        return None
