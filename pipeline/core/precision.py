"""Floating-point formats: their names, and which the hardware computes natively."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The short names (configs, command lines) and torch's own names (HF config files) of each dtype's torch name.
NAMES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}


def __getattr__(name: str):
    """`DTYPES` (each name in NAMES -> its torch.dtype), made on first use: asking which precision the hardware
    computes (the check stage) imports no torch."""
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    globals()["DTYPES"] = dtypes = {short: getattr(torch, full) for short, full in NAMES.items()}
    return dtypes


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (as HF config files write it)."""
    return str(dtype).removeprefix("torch.")


# oneDNN's instruction sets below AVX512_CORE_BF16: capped at one of them (ONEDNN_MAX_CPU_ISA), its bf16 matmuls
# run without the CPU's bf16 instructions, as on a CPU that lacks them
ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def native_bf16(device: str) -> bool:
    """Whether `device` ("cuda" or "cpu") computes in bf16 natively: a GPU that supports it, or a CPU with
    AVX512-BF16 or AMX-BF16 (x86) or the BF16 extension (Arm), read from /proc/cpuinfo, not guessed from the
    vendor, and oneDNN not capped below them. Elsewhere bf16 arithmetic is emulated, and slower than fp32."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = set(Path("/proc/cpuinfo").read_text(encoding="utf-8").split())
    except OSError:
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) and cap not in ONEDNN_WITHOUT_BF16


def inference_dtype(precision: str, device: str) -> torch.dtype:
    """`precision` (auto | bf16 | fp32) as the dtype to compute in on `device`; auto: bf16 where native."""
    import torch

    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return getattr(torch, NAMES[precision])
