import sys

import pytest

from tandem.bench.machine import resident_mb
from tandem.models import memory


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._libc() is None, reason="glibc malloc_trim only")
def test_release_freed_memory_returns_freed_heap_pages():
    blocks, pins = [], []
    for _ in range(2000):  # ~128 MB of touched heap blocks below the mmap threshold, each followed by a
        blocks.append(bytearray(b"x" * (64 * 1024)))  # small live block, so freeing them leaves holes
        pins.append(bytearray(b"p" * 600))  # that glibc does not give back by itself
    del blocks
    before = resident_mb()
    assert memory.release_freed_memory()
    assert before - resident_mb() > 64
    del pins
