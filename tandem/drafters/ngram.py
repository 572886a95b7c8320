"""`ngram`: prompt-lookup drafting over the request's own context (no model, deterministic)."""
from __future__ import annotations

import numpy as np

from tandem.drafters.base import DrafterBase, register
from tandem.errors import InvalidParameterError
from tandem.ops.ngram import ngram_propose
from tandem.types import DraftTree


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(self, num_draft_tokens: int = 4, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max or num_draft_tokens < 1:
            raise InvalidParameterError(f"ngram needs 1 <= n_min <= n_max and num_draft_tokens >= 1, got {n_min}, {n_max}, {num_draft_tokens}")
        self.k, self.n_min, self.n_max = num_draft_tokens, n_min, n_max
        self.max_nodes = num_draft_tokens

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        drafts = []
        for request, budget in zip(requests, budgets):
            k = min(self.k, budget)
            tokens = ngram_propose(np.asarray(request.all_ids), self.n_min, self.n_max, k) if k > 0 else []
            drafts.append(DraftTree.chain(tokens))
        return drafts


@register("ngram")
def _build(num_draft_tokens: int = 4, **_) -> NgramDrafter:
    return NgramDrafter(num_draft_tokens=num_draft_tokens)
