"""Write a safetensors file one tensor at a time: the header is computed from shapes first, then each tensor is
produced, checked, hashed and written straight from its memory, so only one tensor is ever held."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.int32: "I32"}


def raw_bytes(tensor: torch.Tensor):
    """The tensor's bytes as a buffer (no copy when it is already contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def write(
    path: Path,
    entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> dict[str, str]:
    """Write `entries` (name, shape, dtype) in order, each from produce(name); returns {name: sha256}."""
    entries = list(entries)
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digests = {}
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, shape, dtype in entries:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, declared {shape} {dtype}")
            data = raw_bytes(tensor)
            digests[name] = hashlib.sha256(data).hexdigest()
            out.write(data)
            del tensor, data  # before the next one is produced
    return digests
