"""Running a CPU test's comparison on a GPU as well: the device parameter and a deterministic attention there."""

from __future__ import annotations

import contextlib

import pytest
import torch

CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")  # skipped where CUDA is not available (conftest.py)


def deterministic_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """On a GPU, SDPA's math backend: the flash and memory-efficient backward passes may accumulate with atomics,
    and two runs compared bit for bit (stock layers against ours) must see the same attention gradients. On a CPU,
    nothing changes."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)
