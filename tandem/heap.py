"""How a training process's allocator treats large tensors (glibc only; elsewhere nothing changes).

glibc gives every allocation above its mmap threshold (at most 32 MB, adjusted as blocks are freed) a fresh mapping
and unmaps it on free, so the next allocation of the same size page-faults and the kernel zeroes every page again.
A trainer step allocates several tensors of that size each step: a flywheel step's [rows, 16k] logits and their
gradient are ~48 MB each. Allocating and filling one took 15-19 ms where reused memory takes ~2 ms (100 rounds of
two such tensors: 3.8-4.2 s, 3.5-3.9 s of it in the kernel, against 0.50 s). The zeroing is also memory traffic,
and the serving core next to a trainer pays for that traffic (docs/BENCHMARKS.md 10).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
KEEP_BYTES = 1 << 30  # free memory at the heap's top is handed back to the system only above this


def reuse_freed_memory() -> bool:
    """Serve every allocation from the heap and keep what is freed (up to KEEP_BYTES at the top), so a step's large
    tensors reuse the previous step's memory. The process's resident memory stays at its peak (a trainer's is one
    step's working set). True where applied (glibc), False elsewhere. For training processes only: a serving
    process keeps glibc's defaults."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
