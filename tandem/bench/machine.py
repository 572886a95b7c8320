"""What a benchmark ran on, and the memory bandwidth the roofline divides by (measured in the same run)."""
from __future__ import annotations

import hashlib
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from tandem.errors import UnsteadyMachineError

T = TypeVar("T")
PROBE_TOLERANCE = 0.15  # |after / before - 1| beyond this: the machine changed under the timed section


def machine_info() -> dict:
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or ("spin " + os.environ["GOMP_SPINCOUNT"] if "GOMP_SPINCOUNT" in os.environ else "default (spins)"),
    }


def source_sha256() -> str:
    """One digest of the tandem package's Python sources: two runs with the same digest ran the same code."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


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


def probe_bandwidth_gbps() -> float:
    """The probe run before and after each timed section: memory_bandwidth_gbps with 3 reps of each read (8 passes
    over 512 MB, still far beyond the caches). Measured: 2.1-4.0 s a call on a loaded 2-vCPU EPYC box reading ~5 GB/s
    (5 reps: 3.2-3.6 s). At a quiet box's ~30 GB/s the 8 reads come to ~0.15 s, plus writing the buffer once.
    It runs twice per roofline row."""
    return memory_bandwidth_gbps(reps=3)


@dataclass(frozen=True)
class BandwidthProbe:
    """Memory bandwidth (GB/s) measured right before and right after one timed section. Not `steady`: the
    machine's bandwidth moved by more than PROBE_TOLERANCE across it, so a fraction of the roofline computed
    for that section is not comparable with other rows'."""

    before_gbps: float
    after_gbps: float

    @property
    def ratio(self) -> float:
        return self.after_gbps / self.before_gbps

    @property
    def steady(self) -> bool:
        return abs(self.ratio - 1) <= PROBE_TOLERANCE

    @property
    def mean_gbps(self) -> float:
        """What the section's roofline divides by: neither end alone stands for the whole section."""
        return (self.before_gbps + self.after_gbps) / 2

    def as_dict(self) -> dict:
        return {"before_gbps": round(self.before_gbps, 2), "after_gbps": round(self.after_gbps, 2), "mean_gbps": round(self.mean_gbps, 2),
                "ratio": round(self.ratio, 3), "steady": self.steady}


def bracketed(section: Callable[[], T], probe: Callable[[], float] = probe_bandwidth_gbps) -> tuple[T, BandwidthProbe]:
    """Run `section` between two bandwidth probes; its result and the probes."""
    before = probe()
    result = section()
    return result, BandwidthProbe(before, probe())


def describe_unsteady(row: str, before_gbps: float, after_gbps: float) -> str:
    return (f"row {row!r}: memory bandwidth {before_gbps:.1f} GB/s before, {after_gbps:.1f} GB/s after "
            f"({after_gbps / before_gbps - 1:+.0%}, beyond the {PROBE_TOLERANCE:.0%} tolerance)")


def require_steady(row: str, probe: BandwidthProbe, strict: bool) -> None:
    """--strict-probe: refuse a row whose probes differ by more than the tolerance (else it is only flagged)."""
    if strict and not probe.steady:
        raise UnsteadyMachineError(f"{describe_unsteady(row, probe.before_gbps, probe.after_gbps)}; --strict-probe refuses it: "
                                   "rerun on a quiet machine, or drop --strict-probe to keep the row flagged")


def resident_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; 0.0 where unavailable)."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
             "amx_bf16", "avx_vnni")  # what the kernels (and the peers' kernels) can use, in /proc/cpuinfo spelling


def machine_description() -> dict:
    """machine_info plus what a reader needs to compare a report with another machine's: the ISA flags the
    kernels care about, the kernels' blocks in use, total memory and the UTC date."""
    from tandem.models import cpu_gemm

    kernels = cpu_gemm.isa() if cpu_gemm.available() else "not built (oneDNN GEMMs)"
    return machine_info() | {"cpu_id": _cpu_id(), "isa_flags": cpu_flags(ISA_FLAGS), "kernel_isa": kernels, "memory_gib": _memory_gib(),
                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def cpu_flags(wanted=ISA_FLAGS) -> list[str]:
    """The `wanted` flags this CPU has (Linux /proc/cpuinfo; empty where it is unreadable), in `wanted` order."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def _memory_gib() -> float | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _cpu_id() -> str:
    """Vendor, family and model number (Linux /proc/cpuinfo): what tells two "AMD EPYC" boxes apart (family 25 = Zen 3/4,
    26 = Zen 5); "" where unreadable."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip():
                break
    except OSError:
        return ""
    return " ".join(f"{k} {fields[k]}" for k in ("vendor_id", "cpu family", "model") if k in fields)
