"""Give freed heap memory back to the operating system.

Loading and packing a model frees large temporaries (safetensors copies, fused q/k/v and gate/up
sources, dense weights replaced by their oneDNN copies). glibc keeps such freed blocks in its arenas, so
they stay resident; `malloc_trim(0)` returns them. Measured on SmolLM2-135M: 694 -> 622 MB resident for
target + packs (docs/BENCHMARKS.md 1.3). A no-op where glibc is absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS; True when something was released."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
