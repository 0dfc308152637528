"""Names of the floating-point formats the pipeline reads and writes."""

from __future__ import annotations

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
