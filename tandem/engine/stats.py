"""Engine-wide counters (the Prometheus-style spec-decode counters vLLM users ask for)."""
from __future__ import annotations

from dataclasses import dataclass, field


def add_position_counts(drafted: list[int], accepted: list[int], nodes_per_depth: list[int], num_accepted: int) -> None:
    """Add one draft to per-depth counters: nodes drafted at each depth, and 1 for each accepted depth."""
    while len(drafted) < len(nodes_per_depth):
        drafted.append(0)
        accepted.append(0)
    for depth, count in enumerate(nodes_per_depth):
        drafted[depth] += count
    for depth in range(num_accepted):
        accepted[depth] += 1


@dataclass
class EngineStats:
    steps: int = 0  # decode (verify) steps
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0  # of prefill_tokens: prompt tokens whose KV was copied from a request with the same prompt
    output_tokens: int = 0
    drafts: int = 0  # per-request drafts verified (non-empty)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens emitted by verify steps (accepted + recovered/bonus)
    request_steps: int = 0  # sum over steps of the batch size
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    ragged_steps: int = 0  # verify forwards whose rows drafted different amounts, run without padding
    verified_tokens: int = 0  # tokens the verify forwards ran (pending + draft per row; padded forwards count the padding)

    def record_step(self, requests, drafts, results, draft_s: float, verify_s: float) -> None:
        self.steps += 1
        self.request_steps += len(requests)
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        for draft, result in zip(drafts, results):
            self.emitted_tokens += len(result.tokens)
            if not len(draft):
                continue
            self.drafts += 1
            self.drafted_tokens += len(draft)
            self.accepted_tokens += result.num_accepted
            add_position_counts(self.drafted_per_position, self.accepted_per_position, draft.nodes_per_depth(), result.num_accepted)

    @property
    def acceptance_length(self) -> float:
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "prefill_tokens": self.prefill_tokens, "shared_prefill_tokens": self.shared_prefill_tokens, "output_tokens": self.output_tokens,
            "drafts": self.drafts, "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position), "drafted_per_position": list(self.drafted_per_position),
            "draft_time_s": round(self.draft_time_s, 4), "verify_time_s": round(self.verify_time_s, 4),
            "ragged_steps": self.ragged_steps, "verified_tokens": self.verified_tokens,
        }
