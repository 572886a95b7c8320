"""Hardware presets: vendor peak figures (sources named) and this CPU (measured / calibrated).

Vendor peaks are never reached; `replica_machine` (tandem.sim.parallel) applies the efficiency
assumptions written there. Dense (no sparsity) tensor-core figures throughout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bandwidth: float  # bytes/s, HBM / DRAM, per device
    peak_flops: dict[str, float] = field(default_factory=dict)  # dense FLOP/s per device by precision
    link_bandwidth: float = 0.0  # bytes/s per device, one direction, over the scale-up interconnect (NVLink)
    link_latency_s: float = 0.0  # one small all-reduce across a tensor-parallel group
    memory_gb: float = 0.0
    launch_s_per_layer: float = 0.0  # fixed per-layer cost of one forward (kernel launches, sync)
    source: str = ""

    def flops(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise InvalidParameterError(f"{self.name} has no {precision} figure; known: {sorted(self.peak_flops)}")
        return self.peak_flops[precision]


TB = 1e12
PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): HBM3 3.35 TB/s, 80 GB; BF16 989.4 TFLOPS and FP8
    # 1,978.9 TFLOPS dense (the datasheet's 1,979 / 3,958 are with sparsity); NVLink 4 900 GB/s total
    # (450 GB/s per direction).
    "h100": Hardware("h100", 3.35 * TB, {"bf16": 989.4e12, "fp8": 1978.9e12}, 450e9, 8e-6, 80, 8e-6,
                     "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): HBM3e 4.8 TB/s, 141 GB; same compute and NVLink as H100.
    "h200": Hardware("h200", 4.8 * TB, {"bf16": 989.4e12, "fp8": 1978.9e12}, 450e9, 8e-6, 141, 8e-6,
                     "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA GB200 NVL72 product page, per Blackwell GPU (rack figures / 72): HBM3e 576 TB/s -> 8 TB/s,
    # 13.4 TB -> 186 GB; FP8 720 PFLOPS sparse -> 5 PFLOPS dense, BF16 2.5 PFLOPS dense; NVLink 5 1.8 TB/s
    # total per GPU (900 GB/s per direction).
    "gb200": Hardware("gb200", 8.0 * TB, {"bf16": 2.5e15, "fp8": 5.0e15}, 900e9, 5e-6, 186, 6e-6,
                      "NVIDIA GB200 NVL72 product page (per-GPU share of the rack figures)"),
    # This project's CPU (docs: /work/shared/RESOURCES.md): 2 vCPU AMD EPYC Zen 3, AVX2; gemv read
    # bandwidth 20-28 GB/s and ~60 GFLOP/s fp32 on 2 threads, measured. `tandem calibrate` replaces
    # these with a fitted Machine for a given model (tandem.sim.calibration).
    "cpu": Hardware("cpu", 25e9, {"fp32": 60e9}, 0.0, 0.0, 24, 0.0, "measured here (RESOURCES.md); calibrate to refine"),
}


def preset(name: str) -> Hardware:
    if name not in PRESETS:
        raise InvalidParameterError(f"unknown hardware {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
