"""Which code path each CPU-dependent part of a step takes in this process, by name: PyTorch's own kernels (ATen,
`ATEN_CPU_CAPABILITY`), oneDNN's matmuls (bf16, and fp32 through `linear`; `ONEDNN_MAX_CPU_ISA`), MKL's fp32 matmuls
(chosen by the CPU's vendor and model; `MKL_CBWR`) and our C++ kernels (`PIPELINE_KERNELS_ISA`). Each rounds in the
order its path sums, so bf16 and fp32 figures differ from one CPU to the next; train's metrics and the tests' header
name the paths, so that a figure or a failure says which it ran (docs/cpu_paths.md)."""

from __future__ import annotations

import os
import platform
import re
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which MKL dispatches by."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    name = next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "")
    return name or platform.processor() or platform.machine()


@cache
def onednn_isa() -> str:
    """The instruction set oneDNN runs on here, as oneDNN itself names it (its verbose header, read from one small
    fp32 matmul run with verbose on); "unavailable" in a PyTorch built without it."""
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if linear is None:
        return "unavailable"
    x = torch.ones(16, 16)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)  # oneDNN prints to the C library's stdout
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                linear(x, x, None, "none", [], "")
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    found = re.search(r"^onednn_verbose,.*?,isa:(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else "unknown (oneDNN printed no header)"


def mkl_path() -> str:
    """MKL's fp32 path: chosen by the CPU (auto), unless MKL_CBWR or MKL_ENABLE_INSTRUCTIONS pins it."""
    pinned = [f"{k}={os.environ[k]}" for k in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(k)]
    return " ".join(pinned) or "auto"


def describe(*, kernels: bool) -> dict[str, str]:
    """The paths of this process: CPU model, ATen's capability, oneDNN's ISA, MKL's, and our C++ kernels' (where
    they run: `kernels`; built on first use)."""
    from pipeline.kernels import cpp

    return {
        "cpu": cpu_model(),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "onednn": onednn_isa(),
        "mkl": mkl_path(),
        "kernels": cpp.path() if kernels else "off",
    }
