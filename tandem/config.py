"""Frozen, validated configuration records. One per component; the CLI only fills these in."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples from the target (the same with and without speculation)."""

    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request generator seed; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings (text not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (included)
    ignore_eos: bool = False  # keep generating past the model's EOS token
    logprobs: bool = False  # record each output token's log-prob (sampled distribution and untempered policy)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        _check(isinstance(self.logprobs, bool), f"logprobs must be a bool, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParameterError(message)


# served target weights -> Linear.pack's gemm: "auto" keeps the fp32 weights (small-M kernel or oneDNN, exact);
# "bf16", "int8" (rows with one scale each) and "int4" (groups of 32 with an fp16 scale and min), both with int8 activations, serve a different, smaller model through
# their own batch-invariant kernels: speculation stays lossless w.r.t. it (tandem.models.quant_gemm)
WEIGHTS = {"fp32": "auto", "bf16": "bf16", "int8": "int8", "int4": "int4"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide limits and switches."""

    max_batch_size: int = 8  # requests decoded together in one step
    max_model_len: int | None = None  # KV cache length per request; None = the model's context
    num_threads: int | None = None  # torch CPU threads; None = leave as is
    pack_weights: bool = True  # set CPU linears up for inference (tandem.models.linear.Linear.pack) so k-token verifies stay cheap
    weights: str = "fp32"  # "fp32" (exact), "bf16", "int8" or "int4": the target's served weights (WEIGHTS)
    record_steps: bool = False  # StepRecords carry target probs / hidden states (the flywheel needs them)
    record_topk: int = 8  # detailed records keep the top-k of the target's distribution per read position (0 = none)
    hidden_taps: tuple[int, ...] = field(default_factory=tuple)  # target layers whose hidden states are kept
    ragged_verify: bool = True  # rows that draft different amounts verify without padding (fused CPU path); False: pad to the widest
    compile: bool = False  # torch.compile the decode / verify forward (tandem.models.compiled); eager where no compiler
    prefill_batch_tokens: int = 2048  # > 0: prompts admitted together (> 32 tokens each) prefill packed in shared forwards
    # of <= this many tokens, with the same outputs (Transformer.forward_packed; 60 prompts 1.07x faster end to end, the
    # first step 1.1-1.2x; 2,048 beat 1,024 / 4,096 / 8,192, docs/BENCHMARKS.md 1.11); 0: one forward per prompt
    prefill_chunk_tokens: int = 0  # > 0: at most this many prompt tokens prefill per step, long prompts in chunks between
    # decode steps (this replaces batched prefill)
    share_prompt_prefill: bool = True  # requests admitted in one step with the same prompt (a GRPO group, n > 1) prefill it once

    def __post_init__(self) -> None:
        _check(isinstance(self.max_batch_size, int) and self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size!r}")
        _check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2), f"max_model_len must be >= 2, got {self.max_model_len!r}")
        _check(isinstance(self.record_topk, int) and self.record_topk >= 0, f"record_topk must be >= 0, got {self.record_topk!r}")
        _check(isinstance(self.prefill_batch_tokens, int) and self.prefill_batch_tokens >= 0, f"prefill_batch_tokens must be >= 0, got {self.prefill_batch_tokens!r}")
        _check(isinstance(self.prefill_chunk_tokens, int) and self.prefill_chunk_tokens >= 0, f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens!r}")
        _check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1), f"num_threads must be >= 1, got {self.num_threads!r}")
        _check(self.weights in WEIGHTS, f"weights must be one of {sorted(WEIGHTS)}, got {self.weights!r}")
        _check(self.weights == "fp32" or self.pack_weights, f"weights={self.weights!r} serves packed copies: it needs pack_weights=True")
