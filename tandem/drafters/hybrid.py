"""`eagle_ngram` / `eagle_tree_ngram`: the EAGLE head's draft plus a prompt-lookup branch, verified in one pass.

The two drafters fail in different places: prompt lookup wins where the answer copies the context (SQL
identifiers from the schema, translations, quoted code), the head where it must predict. For greedy requests
the n-gram continuation is grafted onto the head's chain or tree (shared prefixes become one path); the target
verifies the union and keeps the longest accepted path, so the output is the target's greedy output either way.
Sampled requests get the head's draft alone (its draft_probs are what keeps a sampled verify lossless).

The head owns all state (its KV cache, pending features, weight version): on_verified hands it the verified
tree's accepted path, whichever branch it came from; the n-gram side is stateless.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tandem.drafters.base import build_drafter, register
from tandem.drafters.eagle import EagleDrafter
from tandem.drafters.ngram import NgramDrafter
from tandem.ops.ngram import ngram_candidates
from tandem.ops.tree import graft_sequence
from tandem.types import DraftShape, DraftTree


class EagleNgramDrafter:
    def __init__(self, eagle: EagleDrafter, ngram: NgramDrafter, name: str = "eagle_ngram"):
        self.eagle, self.ngram, self.name = eagle, ngram, name
        self.taps = eagle.taps
        self.max_nodes = eagle.max_nodes + ngram.k

    # the head is what the flywheel trains and hot-swaps, and its version is the drafter's
    @property
    def head(self):
        return self.eagle.head

    @property
    def version(self) -> int:
        return self.eagle.version

    @version.setter
    def version(self, value: int) -> None:
        self.eagle.version = value

    def shapes(self) -> tuple[DraftShape, ...]:
        """The head's own shapes (the lookup branch grafted where it shares their nodes), then the head's largest
        draft plus a lookup branch of 1..k more nodes: the same passes, more nodes. The controller measures what each
        emits, the grafted branch included, which the head's per-depth acceptance alone does not see. Over a head that
        drafts chains the drafts nest (`prefix`): budget b's draft is the first b nodes of any larger budget's (the head's
        chain, cut where it is unsure, then the lookup branch's nodes in order), so one verify measures every smaller shape."""
        head = self.eagle.shapes()
        top = head[-1]
        shapes = head + tuple(DraftShape(top.budget + n, top.depth, f"{top.name}+lookup{n}") for n in range(1, self.ngram.k + 1))
        nested = all(s.budget == s.depth for s in head)  # a tree head's top nodes by score are not its first nodes
        return tuple(replace(s, prefix=s.budget if nested else 0) for s in shapes)

    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        """The head drafts first (up to its own max_nodes); greedy requests then get the n-gram branch in the
        rest of their budget."""
        drafts = self.eagle.propose(requests, [min(b, self.eagle.max_nodes) for b in budgets])
        return [self._graft(r, d, b) if r.params.greedy and len(d) and b > 0 else d for r, d, b in zip(requests, drafts, budgets)]

    def _graft(self, request, draft: DraftTree, budget: int) -> DraftTree:
        context = np.asarray(request.all_ids)
        found = ngram_candidates(context, self.ngram.n_min, self.ngram.n_max, self.ngram.k, 1)
        if not found:
            return draft
        tokens, parents = graft_sequence(draft.tokens.tolist(), draft.parents.tolist(), found[0], budget)
        if len(tokens) == len(draft):
            return draft
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def on_prefill(self, request, target_out) -> None:
        self.eagle.on_prefill(request, target_out)

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        self.eagle.on_verified(requests, drafts, results, starts, target_out)

    def release(self, request) -> None:
        self.eagle.release(request)

    def move_row(self, src_row: int, dst_row: int) -> None:
        self.eagle.move_row(src_row, dst_row)

    def attach_target_cache(self, cache) -> None:
        self.eagle.attach_target_cache(cache)


@register("eagle_ngram")
def _build(target, num_draft_tokens: int = 4, **kwargs) -> EagleNgramDrafter:
    eagle = build_drafter("eagle", target=target, num_draft_tokens=num_draft_tokens, **kwargs)
    return EagleNgramDrafter(eagle, NgramDrafter(num_draft_tokens=num_draft_tokens))


@register("eagle_tree_ngram")
def _build_tree(target, num_draft_tokens: int = 4, **kwargs) -> EagleNgramDrafter:
    eagle = build_drafter("eagle_tree", target=target, num_draft_tokens=num_draft_tokens, **kwargs)
    return EagleNgramDrafter(eagle, NgramDrafter(num_draft_tokens=num_draft_tokens), name="eagle_tree_ngram")
