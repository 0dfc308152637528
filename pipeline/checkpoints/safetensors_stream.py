"""Write a safetensors file one tensor at a time: the header is computed from shapes first, then each tensor is
produced, checked, hashed and written straight from its memory, so only one tensor is ever held."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.imports import torch
from pipeline.core.precision import dtype_name

CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32"}  # torch dtype: code


def all_finite(tensor: torch.Tensor, block: int = 1 << 20) -> bool:
    """No NaN or Inf, checked a block at a time (isfinite on a whole tensor allocates a copy of it)."""
    return all(torch.isfinite(part).all() for part in tensor.reshape(-1).split(block))


def raw_bytes(tensor: torch.Tensor):
    """The tensor's bytes as a buffer (no copy when it is already contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def write(
    path: Path,
    entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
) -> dict[str, str]:
    """Write `entries` (name, shape, dtype) in order, each from produce(name); returns {name: sha256}."""
    entries = list(entries)
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": CODES[dtype_name(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
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


SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str, key: str) -> int:
    """Bytes of a size as save_pretrained's max_shard_size takes it ("2GB", "500MB"); refused naming `key`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", text.upper())
    if match is None:
        raise ValueError(f"{key}: {text!r}; expected a size such as 2GB or 500MB")
    return int(float(match[1]) * SIZE_UNITS[match[2]])


def write_shards(
    out: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    *,
    max_bytes: int,
) -> int:
    """Write `entries` in order into `out`'s shards of at most `max_bytes` (a larger tensor gets a shard alone),
    named as save_pretrained names them (one: model.safetensors; more: numbered, with their index), one tensor in
    memory at a time; how many shards."""
    sizes = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size() for name, shape, dtype in entries}
    layout = _layout([name for name, _, _ in entries], sizes, max_bytes)
    count = len(layout)
    names = (
        [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        if count > 1
        else ["model.safetensors"]
    )
    declared = {name: (name, shape, dtype) for name, shape, dtype in entries}
    for name, shard in zip(names, layout, strict=True):
        write(out / name, [declared[key] for key in shard], produce)
    if count > 1:
        weight_map = {key: name for name, shard in zip(names, layout, strict=True) for key in shard}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return count


def _layout(keys: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Shards in the order of `keys`, each at most max_bytes (a tensor larger than that gets a shard alone)."""
    shards, current, size = [], [], 0
    for key in keys:
        if current and size + sizes[key] > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += sizes[key]
    return [*shards, current] if current else shards


NAMES = {code: name for name, code in CODES.items()}
CHUNK = 1 << 24  # bytes read at a time when hashing


def dtype_of(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code ("F32")."""
    return getattr(torch, NAMES[code])


def read_header(path: Path) -> tuple[dict, int]:
    """({name: {dtype, shape, data_offsets}}, where the data starts), without reading any tensor."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


@dataclass(frozen=True)
class Stored:
    """A tensor inside a safetensors file: its shape from the header, its values read on demand."""

    path: Path
    name: str
    header: dict
    start: int

    @property
    def shape(self) -> list[int]:
        return self.header[self.name]["shape"]

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.header[self.name]["dtype"])

    def read(self) -> torch.Tensor:
        """The tensor, read with plain file reads (no memory map: the file's pages never count as ours)."""
        entry = self.header[self.name]
        tensor = torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]))
        begin, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            if f.readinto(raw_bytes(tensor)) != end - begin:
                raise ValueError(f"{self.path}: truncated: tensor {self.name} ends past the end of the file")
        return tensor

    def read_flat(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor, read alone (a rank's slice of a parameter)."""
        entry = self.header[self.name]
        tensor = torch.empty(count, dtype=dtype_of(entry["dtype"]))
        size = tensor.element_size()
        with open(self.path, "rb") as f:
            f.seek(self.start + entry["data_offsets"][0] + start * size)
            if f.readinto(raw_bytes(tensor)) != count * size:
                raise ValueError(f"{self.path}: truncated: tensor {self.name} ends past the end of the file")
        return tensor

    def digest(self) -> str:
        """sha256 of the tensor's bytes, read in chunks."""
        begin, end = self.header[self.name]["data_offsets"]
        sha = hashlib.sha256()
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            for offset in range(begin, end, CHUNK):
                sha.update(f.read(min(CHUNK, end - offset)))
        return sha.hexdigest()


def stored(path: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file, nothing read yet."""
    header, start = read_header(path)
    return {name: Stored(path, name, header, start) for name in header}


INDEX = "model.safetensors.index.json"  # the shards of a model saved in several files
