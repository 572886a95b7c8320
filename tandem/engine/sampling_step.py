"""The sampling side of a verify step, batched over its requests: each request's target distribution where its
verify needs one, and the log-probs of the tokens it emitted. Pure functions of the requests' sampling parameters
and the verify forward's logits (a row's result never depends on the other rows)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.adjust import adjusted_logits, draft_paths, emitted_paths
from tandem.engine.request import Request
from tandem.ops.sampling import keyed_sample, race_key, sampling_probs, token_logprobs, top_logprobs
from tandem.ops.tree import depths
from tandem.types import DraftTree


def sampling_tensors(requests: list[Request]) -> tuple[torch.Tensor, ...]:
    """temperature [N], top_k [N] (long), top_p [N], min_p [N] of one request per row, as ops.sampling takes them."""
    params = [r.params for r in requests]
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32), torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32), torch.tensor([p.min_p for p in params], dtype=torch.float32))


def target_probs(requests: list[Request], logits: torch.Tensor, paths: list[list[int]] | None = None) -> torch.Tensor:
    """logits [N, V], one request per row; paths: the drafted tokens before each row (tandem.engine.adjust; None: roots)."""
    return sampling_probs(adjusted_logits(logits.float().cpu(), requests, paths), *sampling_tensors(requests))


def seeded_draw(request: Request, draft: DraftTree, probs: torch.Tensor) -> Callable[[int], int]:  # probs [N+1, V]
    """row -> a seeded request's own token at the root (row 0) or after draft node i (row i + 1): its draw from that
    row's target_probs keyed by (seed, sequence position), as decoding without the draft draws the token at that
    position. Made when the verify reaches the row (a rejected draft's rows never are)."""
    depth = [0] + [d + 1 for d in depths(draft.parents).tolist()]
    first = len(request.all_ids)  # the sequence position of the token after the pending one
    return lambda row: int(keyed_sample(probs[row : row + 1], [race_key(request.params.seed, first + depth[row])])[0])


def step_target_probs(requests: list[Request], drafts: list[DraftTree], logits: torch.Tensor, needed: list[bool]) -> list[torch.Tensor | None]:
    """Each request's target_probs [N+1, V] where needed[b] (sampled, or recorded), from one sampling_probs call over
    all those rows; logits [B, T, V] of the verify forward."""
    rows_of = [b for b, need in enumerate(needed) if need]
    found: list[torch.Tensor | None] = [None] * len(requests)
    if not rows_of:
        return found
    sizes = [len(drafts[b]) + 1 for b in rows_of]
    rows = torch.cat([logits[b, :n] for b, n in zip(rows_of, sizes)])
    owners = [requests[b] for b, n in zip(rows_of, sizes) for _ in range(n)]
    paths = [path for b in rows_of for path in draft_paths(drafts[b])]
    for b, part in zip(rows_of, target_probs(owners, rows, paths).split(sizes)):
        found[b] = part
    return found


def emitted_logprobs(requests: list[Request], results: list, logits: torch.Tensor,
                     probs: list[torch.Tensor | None] | None = None) -> list[list[tuple] | None]:
    """Per request, (sampled, policy, top) log-probs of each emitted token, read from the verify forward (logits
    [B, T, V]) at the position it was drawn (the root, then after each accepted node): the same rows plain
    decoding would read; None where the request did not ask. One call for the step's requests; probs: the
    verify's target_probs per request (reused for the sampled log-probs where all of them have them). top: the
    request's top_logprobs most likely (token, policy log-prob), or None when it asked for none."""
    wanted = [b for b, r in enumerate(requests) if r.params.logprobs]
    found: list[list[tuple[float, float]] | None] = [None] * len(requests)
    if not wanted:
        return found
    rows = {b: [0] + [1 + j for j in results[b].accepted_nodes] for b in wanted}
    picked = logits[[b for b in wanted for _ in rows[b]], [t for b in wanted for t in rows[b]]].float().cpu()  # [M, V]
    tokens = torch.tensor([token for b in wanted for token in results[b].tokens])
    if probs is not None and all(probs[b] is not None for b in wanted):
        sampled = torch.cat([probs[b][rows[b]] for b in wanted]).gather(-1, tokens.view(-1, 1)).squeeze(-1).log()
        policy = torch.log_softmax(picked, dim=-1).gather(-1, tokens.view(-1, 1)).squeeze(-1)
    else:
        owners = [requests[b] for b in wanted for _ in rows[b]]
        paths = [path for b in wanted for path in emitted_paths(results[b].tokens)]
        sampled, policy = token_logprobs(adjusted_logits(picked, owners, paths), tokens, *sampling_tensors(owners), policy_logits=picked)
    pairs = list(zip(sampled.tolist(), policy.tolist(), _top_logprobs([requests[b] for b in wanted for _ in rows[b]], picked)))
    for b in wanted:
        found[b], pairs = pairs[: len(rows[b])], pairs[len(rows[b]) :]
    return found


def _top_logprobs(owners: list[Request], picked: torch.Tensor) -> list[list[tuple[int, float]] | None]:  # picked [M, V]
    """Per row, its request's top_logprobs most likely (token, untempered log-prob), or None (it asked for none)."""
    k = max(r.params.top_logprobs for r in owners)
    if k == 0:
        return [None] * len(owners)
    values, ids = top_logprobs(picked, min(k, picked.shape[-1]))
    return [list(zip(i[: r.params.top_logprobs], v[: r.params.top_logprobs])) if r.params.top_logprobs else None
            for r, i, v in zip(owners, ids.tolist(), values.tolist())]
