"""The target's sampling transform and sampling from probabilities with passed-in randomness.

The same transform is used with and without speculation: speculative verification compares the
drafter against `target_probs` produced here, so output is distributed exactly as plain sampling.
Greedy (temperature 0) is the degenerate distribution: a one-hot on the argmax.
"""
from __future__ import annotations

import torch


def sampling_probs(
    logits: torch.Tensor,  # [N, V] raw logits
    temperature: torch.Tensor,  # [N]; 0 = greedy
    top_k: torch.Tensor,  # [N] long; 0 = off
    top_p: torch.Tensor,  # [N]; 1.0 = off
) -> torch.Tensor:  # [N, V] float32 probabilities
    logits = logits.float()
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / safe_t.unsqueeze(-1)
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def _mask_top_k_top_p(
    scaled: torch.Tensor,  # [N, V]
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, V] with removed tokens at -inf
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = rank >= k.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    remove = remove | (mass_before >= top_p.unsqueeze(-1).to(sorted_probs.dtype))
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample_from_probs(
    probs: torch.Tensor,  # [N, V]
    uniform: torch.Tensor,  # [N] in [0, 1)
) -> torch.Tensor:  # [N] long
    """Inverse-CDF sampling; a token of probability 0 is never returned."""
    cdf = probs.float().cumsum(-1)
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def draw_uniform(generators: list[torch.Generator | None], count: int = 1) -> torch.Tensor:  # [N, count]
    """One row of uniforms per request, each from that request's own generator (CPU)."""
    rows = [torch.rand(count, generator=g) for g in generators]
    return torch.stack(rows) if rows else torch.empty(0, count)


def token_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits at the positions the tokens were drawn
    tokens: torch.Tensor,  # [N] long: the drawn tokens
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] long
    top_p: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # sampled [N], policy [N]
    """Log-prob of each token under the distribution it was sampled from (`sampling_probs`: greedy rows
    give 0) and under the untempered policy (log_softmax of the raw logits)."""
    index = tokens.view(-1, 1).to(logits.device)
    sampled = sampling_probs(logits, temperature, top_k, top_p).gather(-1, index).squeeze(-1).log()
    policy = torch.log_softmax(logits.float(), dim=-1).gather(-1, index).squeeze(-1)
    return sampled, policy
