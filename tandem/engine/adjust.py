"""The per-request, per-position inputs of the target's sampling transform (tandem.ops.sampling).

min_tokens and the repetition / frequency / presence penalties change the target's distribution at a
position according to the tokens before it. At a verify position that context is the request's prompt and
output plus the drafted tokens on the path from the root to it (`draft_paths`); plain decoding, reaching the
same position after emitting exactly those tokens, builds the same context, so the verified distribution
is the plain one and speculation stays lossless (greedy rows: the one-hot of the adjusted argmax).
"""
from __future__ import annotations

import torch

from tandem.engine.request import Request
from tandem.ops.sampling import apply_penalties, suppress_tokens
from tandem.types import DraftTree


def draft_paths(draft: DraftTree) -> list[list[int]]:
    """Per verify row of this draft (the root, then each node): the drafted tokens from the root down to it."""
    tokens, paths = draft.tokens.tolist(), [[]]
    for i, parent in enumerate(draft.parents.tolist()):
        paths.append(paths[parent + 1] + [tokens[i]])
    return paths


def emitted_paths(tokens: list[int]) -> list[list[int]]:
    """Per emitted token of a step: the tokens this step emitted before it (the path to the row it was drawn at)."""
    return [tokens[:i] for i in range(len(tokens))]


def adjusted_logits(
    logits: torch.Tensor,  # [M, V] raw logits, one row per (request, position)
    owners: list[Request],  # [M] the request of each row
    paths: list[list[int]] | None,  # [M] tokens between the request's output and the row (None: all rows at the root)
) -> torch.Tensor:  # [M, V] float32: min_tokens' suppression and the penalties applied where a request asks
    rows = [i for i, r in enumerate(owners) if r.params.adjusts_logits]
    logits = logits.float()
    if not rows:
        return logits
    vocab, adjusted = logits.shape[-1], logits.clone()
    contexts = [owners[i].output_ids + (paths[i] if paths is not None else []) for i in rows]
    banned = torch.stack([_banned(owners[i], len(c), vocab) for i, c in zip(rows, contexts)])
    picked = suppress_tokens(logits[rows], banned)
    penalized = [j for j, i in enumerate(rows) if owners[i].params.penalized]
    if penalized:
        requests = [owners[rows[j]] for j in penalized]
        prompt_mask = torch.zeros(len(penalized), vocab, dtype=torch.bool)
        counts = torch.zeros(len(penalized), vocab)
        for n, (request, j) in enumerate(zip(requests, penalized)):
            prompt_mask[n, request.prompt_ids] = True
            counts[n] = torch.bincount(torch.tensor(contexts[j], dtype=torch.long), minlength=vocab)[:vocab].float()
        params = [r.params for r in requests]
        picked[penalized] = apply_penalties(picked[penalized], prompt_mask, counts, torch.tensor([p.repetition_penalty for p in params]),
                                            torch.tensor([p.frequency_penalty for p in params]), torch.tensor([p.presence_penalty for p in params]))
    adjusted[rows] = picked
    return adjusted


def _banned(request: Request, emitted: int, vocab: int) -> torch.Tensor:  # [V] bool
    """The request's stop tokens (stop ids, EOS unless ignore_eos: vLLM's) while fewer than min_tokens are emitted."""
    banned = torch.zeros(vocab, dtype=torch.bool)
    if emitted < request.params.min_tokens:
        banned[[t for t in request.min_tokens_stops if t < vocab]] = True
    return banned
