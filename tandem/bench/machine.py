"""What a benchmark ran on, and the memory bandwidth the roofline divides by (measured in the same run)."""
from __future__ import annotations

import os
import platform
import time

import torch


def machine_info() -> dict:
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bandwidth_gbps(size_mb: int = 512, reps: int = 5) -> float:
    """Read bandwidth over a buffer far larger than the caches: the faster of a matrix-vector product (what
    AR decoding does) and a plain reduction, best of `reps`.

    Which one reads faster depends on the machine: on one 2-core box the gemv read ~2x faster than `sum`,
    on another (quiet) `sum` read 79 GB/s and the gemv 24 GB/s while decoding streamed its weights at 33 GB/s.
    Taking either alone would understate the roofline somewhere.
    """
    x = torch.ones(size_mb * 1024 * 1024 // 4).view(-1, 4096)
    v = torch.ones(4096)
    best = float("inf")
    for read in (lambda: torch.mv(x, v), x.sum):
        read()
        for _ in range(reps):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def resident_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; 0.0 where unavailable)."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
