"""A model replica over several devices (tensor parallel over the scale-up interconnect) as one Machine.

Assumptions (written down because vendor peaks are never reached):
- weights and FLOPs split evenly over `tp` devices; streaming reaches BANDWIDTH_EFFICIENCY of HBM,
  matmuls COMPUTE_EFFICIENCY of the dense tensor-core peak;
- every layer does two all-reduces (after attention and after the MLP) of the hidden state of every
  token: ring all-reduce moves 2 (tp - 1) / tp of it per device over the link, plus a fixed latency;
- a forward pays launch_s_per_layer per layer (CUDA graphs assumed: a few microseconds).
"""
from __future__ import annotations

from tandem.errors import InvalidParameterError
from tandem.sim.hardware import Hardware
from tandem.sim.roofline import Machine

BANDWIDTH_EFFICIENCY = 0.8  # achieved / peak HBM bandwidth for large weight streams
COMPUTE_EFFICIENCY = 0.6  # achieved / peak dense tensor-core FLOP/s for skinny decode matmuls


def replica_machine(hw: Hardware, precision: str, tp: int, layers: int, hidden: int, act_bytes: int = 2) -> Machine:
    if tp < 1 or layers < 1 or hidden < 1:
        raise InvalidParameterError(f"need tp, layers, hidden >= 1; got {tp}, {layers}, {hidden}")
    comm_latency = 2 * layers * hw.link_latency_s if tp > 1 else 0.0
    comm_per_token = 0.0
    if tp > 1 and hw.link_bandwidth > 0:
        comm_per_token = 2 * layers * hidden * act_bytes * 2 * (tp - 1) / tp / hw.link_bandwidth
    return Machine(
        name=f"{hw.name} x{tp} {precision}", bandwidth=hw.memory_bandwidth * tp * BANDWIDTH_EFFICIENCY,
        peak_flops=hw.flops(precision) * tp * COMPUTE_EFFICIENCY, overhead_s=layers * hw.launch_s_per_layer + comm_latency,
        per_token_s=comm_per_token, source=hw.source,
    )
