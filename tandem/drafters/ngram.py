"""`ngram` / `ngram_tree`: prompt-lookup drafting over the request's own context (no model, deterministic).

`ngram` drafts the continuation after the most recent longest suffix match; `ngram_tree` merges the
continuations after several matches into one tree, verified in the same single target pass.
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.drafters.base import DrafterBase, register
from tandem.errors import InvalidParameterError
from tandem.ops.ngram import ngram_candidates
from tandem.ops.tree import trie_from_sequences
from tandem.types import DraftTree, chain_shapes


N_MIN, N_MAX = 1, 4  # the suffix lengths matched, longest first: the drafter's defaults (and the flywheel's model of its branch)


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(self, num_draft_tokens: int = 4, n_min: int = N_MIN, n_max: int = N_MAX, candidates: int = 1, max_nodes: int | None = None):
        if not 1 <= n_min <= n_max or num_draft_tokens < 1 or candidates < 1:
            raise InvalidParameterError(
                f"ngram needs 1 <= n_min <= n_max, num_draft_tokens >= 1 and candidates >= 1, got {n_min}, {n_max}, {num_draft_tokens}, {candidates}"
            )
        self.k, self.n_min, self.n_max, self.candidates = num_draft_tokens, n_min, n_max, candidates
        self.max_nodes = max_nodes or num_draft_tokens * candidates

    def shapes(self):
        """One lookup per request whatever the length asked for."""
        return chain_shapes(self.max_nodes, lambda n: 1, "lookup")

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        return [self._propose_one(np.asarray(r.all_ids), b) for r, b in zip(requests, budgets)]

    def _propose_one(self, context: np.ndarray, budget: int) -> DraftTree:
        """At most `budget` nodes (a tree's continuations, each cut to depth min(k, budget), merge into one trie)."""
        if budget <= 0:
            return DraftTree.empty()
        sequences = ngram_candidates(context, self.n_min, self.n_max, min(self.k, budget), self.candidates)
        tokens, parents = trie_from_sequences(sequences, min(self.max_nodes, budget))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@register("ngram")
def _build(num_draft_tokens: int = 4, **_) -> NgramDrafter:
    return NgramDrafter(num_draft_tokens=num_draft_tokens)


@register("ngram_tree")
def _build_tree(num_draft_tokens: int = 4, **_) -> NgramDrafter:
    return NgramDrafter(num_draft_tokens=num_draft_tokens, candidates=3, max_nodes=2 * num_draft_tokens + 2)
