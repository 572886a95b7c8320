"""The roofline cost of one target forward: B sequences x T new tokens each, after C cached tokens.

    seconds(B, T, C) = overhead + per_token * B*T + max(bytes / bandwidth, flops / peak)

`ModelWork` says what a forward must move and compute (from the model's shape only); `Machine` says how
fast a machine moves and computes it (vendor figures, or fitted from timings by tandem.sim.fit). The
overhead term is the fixed cost of a forward (kernel launches, Python, collectives' latency); the
per-token term is work that grows with tokens but is neither weight traffic nor matmul (sampling
over the vocabulary, KV writes, small ops). Pure floats: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class ModelWork:
    """What one forward reads and computes, from the model's shape (dense or mixture of experts)."""

    name: str
    dense_params: float  # parameters every token uses (attention, norms, dense MLPs, embedding rows, head)
    bytes_per_param: float  # 4 fp32, 2 bf16, 1 fp8/int8
    kv_bytes_per_token: float  # K and V of one cached token, all layers
    attn_flops_per_token_ctx: float  # attention FLOPs per new token per cached token (4 * layers * q_heads * head_dim)
    expert_params: float = 0.0  # parameters of ONE expert MLP, summed over layers (MoE only)
    num_experts: int = 0  # experts per layer (MoE only)
    experts_per_token: int = 0  # routed experts each token activates (MoE only)

    def __post_init__(self) -> None:
        if self.dense_params <= 0 or self.bytes_per_param <= 0:
            raise InvalidParameterError("dense_params and bytes_per_param must be > 0")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise InvalidParameterError("experts_per_token must be in (0, num_experts]")

    @property
    def total_params(self) -> float:
        return self.dense_params + self.expert_params * self.num_experts

    @property
    def active_params(self) -> float:
        return self.dense_params + self.expert_params * self.experts_per_token

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per layer that `tokens` tokens route to (uniform routing)."""
        if not self.num_experts:
            return 0.0
        miss = (1.0 - self.experts_per_token / self.num_experts) ** tokens
        return self.num_experts * (1.0 - miss)

    def bytes_moved(self, batch: int, tokens: int, context: int) -> float:
        """Weights touched once per forward + the KV cache read by every sequence."""
        n = batch * tokens
        weights = (self.dense_params + self.expert_params * self.experts_touched(n)) * self.bytes_per_param
        return weights + batch * (context + tokens) * self.kv_bytes_per_token

    def flops(self, batch: int, tokens: int, context: int) -> float:
        n = batch * tokens
        return 2.0 * self.active_params * n + self.attn_flops_per_token_ctx * n * (context + tokens / 2)


@dataclass(frozen=True)
class Machine:
    """How fast a machine (or one model replica of several devices) runs a forward."""

    name: str
    bandwidth: float  # bytes/s the weights stream at
    peak_flops: float  # FLOP/s the matmuls reach
    overhead_s: float = 0.0  # fixed seconds per forward
    per_token_s: float = 0.0  # seconds per token in the batch outside the roofline
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.peak_flops <= 0 or self.overhead_s < 0 or self.per_token_s < 0:
            raise InvalidParameterError(f"machine {self.name!r}: bandwidth and peak must be > 0, overheads >= 0")

    @property
    def ridge(self) -> float:
        """FLOP per byte where memory time equals compute time."""
        return self.peak_flops / self.bandwidth


def forward_seconds(work: ModelWork, machine: Machine, batch: int, tokens: int, context: int) -> float:
    """Predicted seconds of one forward of `batch` sequences x `tokens` new tokens after `context` cached."""
    if batch < 1 or tokens < 1 or context < 0:
        raise InvalidParameterError(f"need batch >= 1, tokens >= 1, context >= 0; got {batch}, {tokens}, {context}")
    memory = work.bytes_moved(batch, tokens, context) / machine.bandwidth
    compute = work.flops(batch, tokens, context) / machine.peak_flops
    return machine.overhead_s + machine.per_token_s * batch * tokens + max(memory, compute)


def is_memory_bound(work: ModelWork, machine: Machine, batch: int, tokens: int, context: int) -> bool:
    memory = work.bytes_moved(batch, tokens, context) / machine.bandwidth
    return memory >= work.flops(batch, tokens, context) / machine.peak_flops


def work_from_config(cfg, name: str, bytes_per_param: float = 4.0, kv_bytes: float = 4.0) -> ModelWork:
    """ModelWork of a dense decoder from its tandem ModelConfig (embedding: one row read per token)."""
    d, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate_size
    head = cfg.vocab_size * d
    return ModelWork(
        name=name, dense_params=layers * per_layer + head + d, bytes_per_param=bytes_per_param,
        kv_bytes_per_token=2 * layers * kv * kv_bytes, attn_flops_per_token_ctx=4.0 * layers * q,
    )
