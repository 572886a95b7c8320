"""A rollout batch decoded to the end: how the batch drains as sequences finish, plain vs speculative (pure math).

Sequences of known lengths start together. Each decode step the live batch B (sequences not yet finished)
runs one forward; plain decoding emits 1 token per sequence per step, a chain of k drafts emits E(k) =
1 + sum_{i<=k} prod_{j<=i} a_j in expectation (a_j: conditional acceptance of draft position j) at the
cost of draft(k) + forward(B, 1 + k). The policy picks k per step: `fixed` always k = max_k, `controller`
the k in 0..max_k with the most tokens per second at the live batch (EfficientRollout's toggle: off where
the batch is large enough that a verify costs more than it returns, on in the tail). Remaining tokens are
tracked in expectation, so a sequence of n tokens takes n / E(k) steps at a steady k.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidParameterError
from tandem.ops.cost import expected_tokens_per_step
from tandem.sim.speculative import DraftCost, ForwardCost


@dataclass(frozen=True)
class RolloutPrediction:
    seconds: float
    steps: int
    ks: list[int]  # the k chosen at each step
    batches: list[int]  # the live batch at each step


def choose_k(forward: ForwardCost, batch: int, context: int, acceptance: list[float], max_k: int, draft: DraftCost) -> int:
    """The chain length in 0..max_k with the most tokens per second for `batch` sequences."""
    best_k, best_rate = 0, 1.0 / forward(batch, 1, context)
    for k in range(1, min(max_k, len(acceptance)) + 1):
        rate = expected_tokens_per_step(acceptance, k) / (draft.seconds(k, batch * k, batch) + forward(batch, 1 + k, context))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def simulate_rollout(lengths: list[int], forward: ForwardCost, acceptance: list[float], max_k: int, policy: str = "controller",
                     draft: DraftCost = DraftCost(), prompt_tokens: int = 0) -> RolloutPrediction:
    """Seconds to decode sequences of `lengths` tokens together (context = prompt + tokens so far, the batch's mean)."""
    if policy not in ("plain", "fixed", "controller"):
        raise InvalidParameterError(f"policy must be plain, fixed or controller, got {policy!r}")
    if not lengths or min(lengths) < 1:
        raise InvalidParameterError("lengths must be non-empty and >= 1")
    remaining = [float(n) for n in lengths]
    seconds, ks, batches, done = 0.0, [], [], 0.0
    while True:
        live = [i for i, r in enumerate(remaining) if r > 1e-9]
        if not live:
            break
        batch, context = len(live), prompt_tokens + int(done)
        k = 0 if policy == "plain" else (min(max_k, len(acceptance)) if policy == "fixed" else
                                          choose_k(forward, batch, context, acceptance, max_k, draft))
        emitted = expected_tokens_per_step(acceptance, k) if k else 1.0
        seconds += forward(batch, 1 + k, context) + (draft.seconds(k, batch * k, batch) if k else 0.0)
        for i in live:
            remaining[i] -= emitted
        done += emitted
        ks.append(k)
        batches.append(batch)
    return RolloutPrediction(seconds, len(ks), ks, batches)


def rollout_speedup(lengths: list[int], forward: ForwardCost, acceptance: list[float], max_k: int, policy: str = "controller",
                    draft: DraftCost = DraftCost(), prompt_tokens: int = 0) -> float:
    """Plain rollout seconds / speculative rollout seconds for the same lengths."""
    plain = simulate_rollout(lengths, forward, acceptance, max_k, "plain", draft, prompt_tokens).seconds
    return plain / simulate_rollout(lengths, forward, acceptance, max_k, policy, draft, prompt_tokens).seconds
