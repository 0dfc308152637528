"""Files written by torch.save, read memory-mapped: tensors stay on disk until read, and the pages of what has
been copied out are handed back. Files in torch's legacy (pre-zip) serialization cannot be mapped: they are read
whole, and their pages are never handed back (they hold the only copy)."""

from __future__ import annotations

import ctypes
import mmap
import zipfile
from pathlib import Path

from pipeline.core.imports import torch

_LIBC = ctypes.CDLL(None, use_errno=True)


def is_legacy(path: Path) -> bool:
    """Whether `path` is in torch's legacy serialization (not a zip archive; a damaged zip reads as one too, and
    then fails to load as such)."""
    return not zipfile.is_zipfile(path)


def release(tensor: torch.Tensor) -> None:
    """Drop the whole pages under a memory-mapped slice from this process's memory (the file keeps them); only
    for tensors of a mapped file."""
    start = tensor.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED
