"""Speculative decoding throughput from per-position acceptance and a forward cost (pure math).

Chains: with a_j = P(position j accepted | positions < j accepted), a k-token draft emits
E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per step. Trees: a_d is the probability that SOME node at
depth d is accepted given depth d-1 was; the same formula over depths, while the verify forward pays for
every node (sum of nodes per depth). Step time = draft(k) + forward(B, 1 + nodes, C).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tandem.errors import InvalidParameterError
from tandem.ops.cost import expected_tokens_per_step

ForwardCost = Callable[[int, int, int], float]  # (batch, tokens per sequence, context) -> seconds


@dataclass(frozen=True)
class DraftCost:
    """Seconds the drafter takes per step for a batch: fixed + per depth (one drafter forward each for
    the whole batch) + per drafted node (e.g. an n-gram lookup) + per sequence (a model drafter first
    catches its cache up on each request's new tokens, one forward per request)."""

    fixed_s: float = 0.0
    per_depth_s: float = 0.0
    per_node_s: float = 0.0
    per_sequence_s: float = 0.0

    def seconds(self, depth: int, nodes: int, sequences: int = 1) -> float:
        if depth <= 0:
            return 0.0
        return self.fixed_s + self.per_depth_s * depth + self.per_node_s * nodes + self.per_sequence_s * sequences

    @staticmethod
    def features(depth: int, nodes: int, sequences: int) -> list[float]:
        """The regressors, in field order (fits solve for the fields as coefficients)."""
        return [1.0, float(depth), float(nodes), float(sequences)]


def expected_tokens_tree(depth_acceptance: list[float]) -> float:
    """Tokens per step for a tree whose depth d is reached with prod_{j<=d} a_j (a per depth)."""
    return expected_tokens_per_step(depth_acceptance, len(depth_acceptance))


def step_tokens_per_s(forward: ForwardCost, batch: int, context: int, acceptance: list[float], nodes_per_depth: list[int],
                      draft: DraftCost = DraftCost()) -> float:
    """Tokens/s of `batch` sequences all drafting a tree with `nodes_per_depth` (chain: [1] * k)."""
    if len(nodes_per_depth) > len(acceptance):
        raise InvalidParameterError(f"acceptance has {len(acceptance)} positions, the draft {len(nodes_per_depth)} depths")
    nodes = sum(nodes_per_depth)
    tokens = expected_tokens_per_step(acceptance, len(nodes_per_depth))
    seconds = draft.seconds(len(nodes_per_depth), batch * nodes, batch) + forward(batch, 1 + nodes, context)
    return batch * tokens / seconds


def best_chain(forward: ForwardCost, batch: int, context: int, acceptance: list[float], max_k: int,
               draft: DraftCost = DraftCost()) -> tuple[int, float]:
    """(k, speedup over plain decoding) of the best chain length k in 0..max_k (k = 0: plain, 1.0)."""
    plain = step_tokens_per_s(forward, batch, context, acceptance, [], draft)
    best = (0, 1.0)
    for k in range(1, min(max_k, len(acceptance)) + 1):
        speedup = step_tokens_per_s(forward, batch, context, acceptance, [1] * k, draft) / plain
        if speedup > best[1]:
            best = (k, speedup)
    return best
