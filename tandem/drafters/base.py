"""The drafter Protocol and registry: a new drafter is a new file with `@register("name")`.

Drafters see requests through `DraftContext` (duck-typed; the engine's Request satisfies it), so they
never import the engine. A drafter must report in `DraftTree.draft_probs` the distribution each token
was actually drawn from (None = picked deterministically): that is what keeps verification lossless.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.ops.sampling import draw_uniform, keyed_sample, race_key, sample_from_probs
from tandem.types import DraftShape, DraftTree, VerifyResult, chain_shapes


class DraftContext(Protocol):
    request_id: str
    row: int  # the request's KV-cache row in the engine (drafters with caches mirror it)
    params: SamplingParams
    generator: torch.Generator

    @property
    def all_ids(self) -> list[int]: ...  # prompt + output; the last one is the pending (root) token


def draw_draft_tokens(
    requests: list[DraftContext],
    probs: torch.Tensor,  # [B, V'] each row's sampling distribution over the drafter's vocabulary (greedy rows one-hot)
    step: int,  # the token drawn is `step` tokens after the one after the pending token (0: the next token)
    vocab_ids: torch.Tensor | None = None,  # [V'] the target's id of each drafter token; None: the target's vocabulary
) -> torch.Tensor:  # [B] long, in the drafter's vocabulary
    """One draft token per row. A seeded row races on the numbers the verify draws its own token with at that position
    (tandem.ops.sampling.keyed_sample), so the draft is the target's own draw as often as a coupling without
    communication allows, and the output never depends on it; an unseeded row draws from its generator (rejection
    sampling verifies it)."""
    seeded = [b for b, r in enumerate(requests) if r.params.seed is not None]
    free = [b for b, r in enumerate(requests) if r.params.seed is None]
    tokens = torch.empty(len(requests), dtype=torch.long)
    if free:
        tokens[free] = sample_from_probs(probs[free], draw_uniform([requests[b].generator for b in free])[:, 0])
    if seeded:
        keys = [race_key(requests[b].params.seed, len(requests[b].all_ids) + step) for b in seeded]
        tokens[seeded] = keyed_sample(probs[seeded], keys, vocab_ids)
    return tokens


class Drafter(Protocol):
    """What the engine calls, in order, for each request:

    on_prefill(request, out)   after the prompt's forward and the first token's commit. out is the target's
                               ForwardOutput for the prompt: out.hidden[i] [1, P, d] per tap (all prompt
                               positions), out.logits [1, 1, V] (last position only). request.all_ids =
                               prompt + [first token].
    propose(requests, budgets) each step, for all running requests (rows 0..B-1): at most budgets[b] nodes.
    on_verified(..., starts, out) after verification and commit. out.hidden[i] [B, T, d]: position 0 is the
                               root (the pending token, at sequence position starts[b]), position 1 + j is
                               draft node j; the accepted path is [0] + [1 + j for j in accepted_nodes].
                               request.all_ids already includes the emitted tokens.
    move_row / release         rows stay contiguous: the engine moves the last row into a finished one.
    attach_target_cache(cache) right before each propose: the proposing engine's KV cache (rows 0..B-1 hold the
                               committed tokens of requests 0..B-1; a drafter may be shared by engines). A drafter
                               that is a copy of the target (self_draft) drafts over it instead of keeping its own.
    shapes()                   the drafts it offers (DraftShape: the budget to ask for and the passes it takes); the
                               speculation controller measures and prices each and asks every row for one per step.
    """

    name: str
    version: int  # weight version; bumps on every hot-swap or re-sync
    max_nodes: int  # most nodes one proposal may have (the engine reserves KV room for them)
    taps: tuple[int, ...]  # target layers whose hidden states the drafter reads from target_out.hidden

    def propose(self, requests: list[DraftContext], budgets: list[int]) -> list[DraftTree]: ...
    def on_prefill(self, request: DraftContext, target_out) -> None: ...
    def on_verified(self, requests: list[DraftContext], drafts: list[DraftTree], results: list[VerifyResult], starts: list[int], target_out) -> None: ...
    def release(self, request: DraftContext) -> None: ...
    def move_row(self, src_row: int, dst_row: int) -> None: ...  # the engine moved a request's row
    def attach_target_cache(self, cache) -> None: ...
    def shapes(self) -> tuple[DraftShape, ...]: ...


class DrafterBase:
    """No-op hooks for stateless drafters."""

    name = "base"
    version = 0
    max_nodes = 0
    taps: tuple[int, ...] = ()

    def on_prefill(self, request, target_out) -> None:
        pass

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        pass

    def release(self, request) -> None:
        pass

    def move_row(self, src_row: int, dst_row: int) -> None:
        pass

    def attach_target_cache(self, cache) -> None:
        pass

    def shapes(self) -> tuple[DraftShape, ...]:
        """Chains of 1..max_nodes nodes, one drafter pass per node (a model drafter's chain)."""
        return chain_shapes(self.max_nodes)


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def registered() -> list[str]:
    return sorted(_REGISTRY)


def build_drafter(name: str, **kwargs) -> Drafter:
    """The drafter registered as `name`, named `name`: calibration records, the controller's cost lookup and stats key on
    `drafter.name`, so `ngram_tree` must not call itself `ngram` (its costs differ)."""
    if name not in _REGISTRY:
        raise InvalidParameterError(f"unknown drafter {name!r}; available: {', '.join(registered())}")
    drafter = _REGISTRY[name](**kwargs)
    drafter.name = name
    return drafter
