"""An HF model folder's (or an adapter's) tensors, whatever format they were saved in, behind one interface
(`shape`, `read()`, `read_flat()`, `digest()`), each read on its own when asked for:

- safetensors, one file or shards with `model.safetensors.index.json`: plain file reads (safetensors_stream.py);
- PyTorch pickles, `pytorch_model.bin` or shards with `pytorch_model.bin.index.json` (older transformers,
  DeepSpeed-Chat): loaded through the checkpoint loader (safe_pickle.py: data only, never code) and memory-mapped
  (see mapped.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.checkpoints import safe_pickle
from pipeline.checkpoints.mapped import is_legacy, release
from pipeline.checkpoints.safetensors_stream import INDEX, raw_bytes, stored
from pipeline.core.imports import torch

SAFETENSORS = "model.safetensors"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class FileTensor(Protocol):
    """A tensor in a file: its shape known, its values read on demand."""

    @property
    def shape(self) -> list[int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self) -> torch.Tensor: ...

    def read_flat(self, start: int, count: int) -> torch.Tensor: ...

    def digest(self) -> str: ...


@dataclass(frozen=True)
class Pickled:
    """A tensor of a torch.save file (memory-mapped unless the file is in the legacy format)."""

    path: Path
    name: str
    value: torch.Tensor
    mapped: bool

    @property
    def shape(self) -> list[int]:
        return list(self.value.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    def read(self) -> torch.Tensor:
        out = self.value.contiguous().clone()
        if self.mapped:
            release(self.value)
        return out

    def read_flat(self, start: int, count: int) -> torch.Tensor:
        return self.value.reshape(-1)[start : start + count].clone()

    def digest(self) -> str:
        return hashlib.sha256(raw_bytes(self.read())).hexdigest()


def pickled(path: Path) -> dict[str, Pickled]:
    """Every tensor of a torch.save'd state dict; refused when it holds anything but tensors."""
    state = safe_pickle.load(path)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict ({{name: tensor}}), found {type(state).__name__}")
    mapped = not is_legacy(path)
    return {name: Pickled(path, name, value, mapped) for name, value in state.items()}


def tensors_of(path: Path) -> dict[str, FileTensor]:
    """Every tensor of one weights file, by its suffix (.safetensors, else a torch.save file)."""
    return dict(stored(path)) if path.suffix == ".safetensors" else dict(pickled(path))


def pickled_state_dict(base_dir: Path) -> dict[str, torch.Tensor] | None:
    """The whole state dict of a model folder whose weights are torch pickles (memory-mapped), None when it has
    safetensors (transformers reads those itself)."""
    tensors = model_tensors(base_dir)
    if all(isinstance(t, Pickled) for t in tensors.values()):
        return {name: tensor.value for name, tensor in tensors.items()}
    return None


def model_tensors(base_dir: Path) -> dict[str, FileTensor]:
    """Every tensor of an HF model folder, in shard order; safetensors preferred when both are there."""
    for index, single in ((INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
        if (base_dir / index).is_file():
            weight_map = json.loads((base_dir / index).read_text(encoding="utf-8")).get("weight_map") or {}
            shards = sorted(set(weight_map.values()))
            if missing := [s for s in shards if not (base_dir / s).is_file()]:
                raise FileNotFoundError(f"{base_dir / index}: names shards that are missing: {missing}")
            return {name: tensor for shard in shards for name, tensor in tensors_of(base_dir / shard).items()}
        if (base_dir / single).is_file():
            return tensors_of(base_dir / single)
    raise FileNotFoundError(f"{base_dir}: no {SAFETENSORS}, {INDEX}, {BIN} or {BIN_INDEX}; expected an HF model folder")
