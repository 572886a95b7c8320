"""Expected speculative throughput from acceptance and measured costs (pure math; the controller uses it).

With a_j = P(draft position j accepted | positions < j accepted), a draft of k tokens emits on average
E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j tokens per step (the 1 is the recovered/bonus token), and costs
draft(k) + verify(k) time. The best k maximises E(k) / (draft(k) + verify(k)); k = 0 is plain decoding.
"""
from __future__ import annotations


def expected_tokens_per_step(alphas: list[float], k: int) -> float:
    total, survive = 1.0, 1.0
    for a in alphas[:k]:
        survive *= a
        total += survive
    return total


def best_draft_length(alphas: list[float], draft_ms_per_token: float, verify_ms: list[float]) -> int:
    """verify_ms[k] = time of one target step verifying k draft tokens (verify_ms[0] = a plain step)."""
    best_k, best_rate = 0, 1.0 / verify_ms[0]
    for k in range(1, min(len(alphas), len(verify_ms) - 1) + 1):
        rate = expected_tokens_per_step(alphas, k) / (k * draft_ms_per_token + verify_ms[k])
        if rate > best_rate * 1.05:  # a margin: don't speculate at break-even, where noise decides
            best_k, best_rate = k, rate
    return best_k
