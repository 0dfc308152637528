"""Floating-point formats: their names, and which the hardware computes natively."""

from __future__ import annotations

from pathlib import Path

import torch

# The short names (configs, command lines) and torch's own names (HF config files) of each dtype.
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (as HF config files write it)."""
    return str(dtype).removeprefix("torch.")


def native_bf16(device: str) -> bool:
    """Whether `device` ("cuda" or "cpu") computes in bf16 natively: a GPU that supports it, or a CPU with
    AVX512-BF16 or AMX-BF16 (x86) or the BF16 extension (Arm), read from /proc/cpuinfo, not guessed from the
    vendor. Elsewhere bf16 arithmetic is emulated, and slower than fp32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = set(Path("/proc/cpuinfo").read_text(encoding="utf-8").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def inference_dtype(precision: str, device: str) -> torch.dtype:
    """`precision` (auto | bf16 | fp32) as the dtype to compute in on `device`; auto: bf16 where native."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return DTYPES[precision]
