"""Frozen, validated configuration records. One per component; the CLI only fills these in."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError


MAX_TOP_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples from the target (the same with and without speculation)."""

    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request generator seed; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings (text not included in the output unless include_stop_str_in_output)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (included)
    ignore_eos: bool = False  # keep generating past the model's EOS token
    logprobs: bool = False  # record each output token's log-prob (sampled distribution and untempered policy)
    top_logprobs: int = 0  # with logprobs: also record the MAX_TOP_LOGPROBS-bounded most likely tokens per position (untempered)
    min_tokens: int = 0  # EOS and stop_token_ids have probability 0 (and stop strings do not match) before this many tokens
    min_p: float = 0.0  # drop tokens whose (tempered) probability is below min_p x the most likely token's; 0 = off
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits / this, negative x this; 1 = off
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per occurrence in the output; 0 = off
    presence_penalty: float = 0.0  # subtracted from the logit of a token that occurs in the output; 0 = off
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text

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
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        _check(self.top_logprobs == 0 or self.logprobs, "top_logprobs needs logprobs=True")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < float("inf"),
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value!r}")
        _check(isinstance(self.include_stop_str_in_output, bool), f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """The target's logits depend on the tokens so far (repetition / frequency / presence penalties)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """The target's distribution is changed per position before sampling (tandem.engine.adjust)."""
        return self.penalized or self.min_tokens > 0


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
    record_topk: int = 0  # detailed records keep the top-k of the target's distribution per read position (0 = none: no trainer reads it, and a softmax + top-k over the vocabulary a step cost the flywheel's serving ~1 %)
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
