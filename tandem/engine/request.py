"""A request's state inside the engine (token ids only) and its metrics."""
from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token, or a stop string (the edge reports the latter)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller


@dataclass
class RequestMetrics:
    """Per-request speculative-decoding metrics (vLLM's names where they exist)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0  # target forwards after prefill (verify steps)
    drafts: int = 0  # steps that verified a non-empty draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft depth i
    drafted_per_position: list[int] = field(default_factory=list)  # drafted count at draft depth i
    draft_lengths: list[int] = field(default_factory=list)  # k chosen at each step (adaptive k)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step, including the recovered/bonus token."""
        return (self.output_tokens - 1) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        if self.finish_time is None:
            return 0.0
        return self.output_tokens / max(self.finish_time - self.arrival_time, 1e-9)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "steps": self.steps,
            "drafts": self.drafts, "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4), "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_per_position": list(self.accepted_per_position), "drafted_per_position": list(self.drafted_per_position),
            "mean_draft_length": round(sum(self.draft_lengths) / len(self.draft_lengths), 3) if self.draft_lengths else 0.0,
            "draft_time_s": round(self.draft_time_s, 6), "verify_time_s": round(self.verify_time_s, 6),
            "prefill_time_s": round(self.prefill_time_s, 6), "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # KV cache row while running
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    tags: dict = field(default_factory=dict)  # e.g. {"domain": "sql"}; carried into StepRecords
    output_logprobs: list[float] = field(default_factory=list)  # params.logprobs: log-prob under the sampled distribution
    output_policy_logprobs: list[float] = field(default_factory=list)  # params.logprobs: under the untempered policy
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # params.top_logprobs: (token, policy log-prob), most likely first
    min_tokens_stops: frozenset[int] = frozenset()  # the tokens held at probability 0 before params.min_tokens (stop ids, EOS unless ignored)

    @staticmethod
    def make_generator(seed: int | None) -> torch.Generator:
        return torch.Generator().manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(62))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def pending_token(self) -> int:
        """The last emitted token: sampled, not yet in the KV cache (the root of the next draft)."""
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
