"""The train ranks' CPU allocator (csrc/allocator.cpp): every tensor of 256 KB and more from one region of its own,
best fit with coalescing, its pages kept for the next step; smaller ones from glibc as before.

With glibc alone, the step's large tensors share the heap with small blocks that live on (the optimizer's states,
DeepSpeed's buffers, allocated amid the first step's activations): the freed space is split, the second step's
tensors no longer fit it in their own order, and the heap grows by what it cannot reuse, paying page faults for it.
With this allocator a rank reaches its high-water mark in the first step (figures: docs/kernels.md)."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.kernels import cpp

SOURCE = Path(__file__).parent / "csrc" / "allocator.cpp"
STARTUP_ENVIRONMENT = {
    # A fixed mmap threshold while loading: glibc otherwise raises it as tensors are freed, keeps load-sized blocks
    # in its heap and never returns them. The loop then keeps its tensors in the heap (keep_freed_memory).
    "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    # No per-thread cache of small freed blocks: held there they sit between the loop's freed tensors, which then
    # cannot merge, and the heap grows for the next step's.
    "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
    # MKL's fp32 matmuls keep their packing buffers, first allocated amid the first step's activations, where they
    # split the freed memory the next step reuses.
    "MKL_DISABLE_FAST_MM": "1",
}


def install() -> bool:
    """Make it PyTorch's CPU allocator for every tensor allocated from now on in this process (once; it cannot be
    undone): the region's address space is reserved as large as the machine's memory, nothing allocated until
    touched. False, and glibc's as before, where it cannot be built or the reservation is refused."""
    compiled = cpp.build(SOURCE)
    return compiled is not None and compiled.install(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usage() -> tuple[int, int]:
    """The region's high-water mark in bytes and how many free blocks lie below its top (0, 0 when not installed)."""
    compiled = cpp.build(SOURCE)
    return tuple(compiled.usage()) if compiled is not None else (0, 0)


def keep_freed_memory() -> None:
    """From now on keep freed memory in this process's heap (glibc): tensors up to 256 MB come from the heap, and it
    is returned to the system only above 1 GB free at its top. A training step frees and reallocates the same
    sizes each time; mapped and unmapped, each step pays the page faults of zeroing them again (figures:
    docs/kernels.md). No effect where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 1 << 28)
    mallopt(m_trim_threshold, 1 << 30)
