"""The target's sampling transform and sampling from probabilities with passed-in randomness.

The same transform is used with and without speculation: speculative verification compares the
drafter against `target_probs` produced here, so output is distributed exactly as plain sampling.
Greedy (temperature 0) is the degenerate distribution: a one-hot on the argmax.

vLLM's order: logits -> `suppress_tokens` (min_tokens) -> `apply_penalties` (repetition, frequency,
presence) -> greedy argmax, or temperature -> min_p -> top-k / top-p -> softmax. The first two depend on
the tokens before the position; the caller passes them per row (the engine: tandem.engine.adjust).

A seeded request draws by an exponential race on numbers keyed by (seed, sequence position): whatever
drafted, and whatever the batch, the token drawn at a position is the same, so seeded sampling gives the
same bits with and without speculation (`race_key`, `keyed_sample`).
"""
from __future__ import annotations

import torch


def sampling_probs(
    logits: torch.Tensor,  # [N, V] raw logits
    temperature: torch.Tensor,  # [N]; 0 = greedy
    top_k: torch.Tensor,  # [N] long; 0 = off
    top_p: torch.Tensor,  # [N]; 1.0 = off
    min_p: torch.Tensor | None = None,  # [N]; 0 = off: drop tokens below min_p x the most likely one's probability
) -> torch.Tensor:  # [N, V] float32 probabilities
    logits = logits.float()
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / safe_t.unsqueeze(-1)
    if min_p is not None and bool((min_p > 0).any()):
        scaled = _mask_min_p(scaled, min_p)
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def _mask_min_p(
    scaled: torch.Tensor,  # [N, V] temperature-scaled logits
    min_p: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, V] with tokens below min_p x max prob at -inf
    """prob(x) < min_p * max prob  <=>  scaled(x) < max scaled + log(min_p): no softmax needed; the most likely
    token always stays (vLLM's MinPLogitsProcessor, on the tempered distribution)."""
    threshold = scaled.max(-1, keepdim=True).values + torch.log(min_p.to(scaled.dtype)).unsqueeze(-1)  # log(0) = -inf: off
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def suppress_tokens(
    logits: torch.Tensor,  # [N, V]
    banned: torch.Tensor,  # [N, V] bool
) -> torch.Tensor:  # [N, V] float32 with banned tokens at -inf
    """min_tokens: a request's stop tokens get probability 0 (and never win the argmax) until it has emitted enough."""
    return logits.float().masked_fill(banned, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,  # [N, V] raw logits
    prompt_mask: torch.Tensor,  # [N, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor,  # [N, V] how often the token occurs in the output before this position
    repetition: torch.Tensor,  # [N]; 1 = off
    frequency: torch.Tensor,  # [N]; 0 = off
    presence: torch.Tensor,  # [N]; 0 = off
) -> torch.Tensor:  # [N, V] float32
    """vLLM's penalties: a token seen in the prompt or output has a positive logit divided by `repetition` and a
    negative one multiplied by it; then `frequency` x its output count and `presence` (once) are subtracted."""
    logits = logits.float()
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (counts > 0)
    factor = repetition.to(logits.dtype).unsqueeze(-1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / factor, logits * factor)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency.to(logits.dtype).unsqueeze(-1) * counts - presence.to(logits.dtype).unsqueeze(-1) * (counts > 0).to(logits.dtype)


def top_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [N, k] (descending), token ids [N, k]
    """The k most likely tokens under the untempered policy (log_softmax of the raw logits): the API's alternatives."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return values, ids


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


GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's increment and finaliser
MASK64 = (1 << 64) - 1
LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
            2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)  # Cephes logf on [sqrt(1/2), sqrt(2))


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def race_key(seed: int, position: int) -> int:  # a signed int64
    """The key of a seeded request's draw at one sequence position: SplitMix64 of the seed, then of the position."""
    key = _mix64((_mix64((seed + GAMMA) & MASK64) + position * GAMMA) & MASK64)
    return key - (1 << 64) if key >> 63 else key


def keyed_sample(
    probs: torch.Tensor,  # [N, W] sampling distributions (need not be normalised)
    keys: list[int],  # [N] race_key of each row
    token_ids: torch.Tensor | None = None,  # [W] long: each column's token id (a drafter's vocabulary); None: the column
) -> torch.Tensor:  # [N] long columns
    """Each row's draw by an exponential race on numbers keyed by (key, token id): the first argmax of p(x) / E(x), where
    E(x) = -log(u(x)) is a standard exponential and u(x) = (2 (h >> 41) + 1) / 2^24, h = SplitMix64(key + (x + 1) GAMMA).
    E(x) / p(x) is exponential of rate p(x), and the smallest of independent exponentials is each one's with probability
    proportional to its rate, so token x wins with probability p(x) / sum(p): the Gumbel-max trick, and a token of
    probability 0 never wins. Plain decoding, a drafter and a verify that draw at one position race on the same numbers,
    so the draw never depends on the draft, and two distributions raced there pick the same token with probability
    >= (1 - tv) / (1 + tv) (tv: their total variation distance). The compiled kernel (csrc/keyed_race.cpp) and
    `keyed_sample_reference` do the same float32 operations in the same order: the same bits."""
    probs = probs.float()
    kernel = _race_kernel() if probs.device.type == "cpu" else None
    if kernel is None:
        return keyed_sample_reference(probs, keys, token_ids)
    return kernel(probs.contiguous(), torch.tensor(keys, dtype=torch.long), None if token_ids is None else token_ids.cpu().long())


def _race_kernel():
    """torch.ops.tandem_cpu.keyed_race where the CPU kernels are built and loaded (tandem.models.cpu_gemm), else None."""
    try:
        return torch.ops.tandem_cpu.keyed_race
    except (AttributeError, RuntimeError):
        return None


def keyed_sample_reference(probs: torch.Tensor, keys: list[int], token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`keyed_sample` in torch ops (int64 products wrap, as the kernel's do)."""
    device = probs.device
    tokens = (torch.arange(probs.shape[-1], device=device) if token_ids is None else token_ids.to(device).long()) + 1
    h = _mix64_tensor(torch.tensor(keys, dtype=torch.long, device=device).unsqueeze(-1) + tokens * _signed(GAMMA))
    uniform = (2 * _shift_right(h, 41) + 1).float() * 2.0**-24  # in (0, 1), exactly
    return (probs.float() / _neg_log(uniform)).argmax(-1)  # argmax: the first maximum, as the kernel's


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:  # logical: int64 >> is arithmetic
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    return z ^ _shift_right(z, 31)


def _neg_log(u: torch.Tensor) -> torch.Tensor:  # u in (0, 1), float32: -log(u), each product and sum rounded on its own
    bits = u.view(torch.int32)
    exponent = ((bits >> 23) - 127).float()
    mantissa = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)
    big = mantissa > 1.41421356
    mantissa = torch.where(big, mantissa * 0.5, mantissa)
    exponent = torch.where(big, exponent + 1.0, exponent)
    f = mantissa - 1.0
    z = f * f
    poly = torch.full_like(f, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        poly = poly * f + c
    y = (f * z) * poly
    y = y + exponent * -2.12194440e-4
    y = y - z * 0.5
    return -((f + y) + exponent * 0.693359375)


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
    min_p: torch.Tensor | None = None,  # [N]
    policy_logits: torch.Tensor | None = None,  # [N, V] the raw logits when `logits` were adjusted (penalties); None: `logits`
) -> tuple[torch.Tensor, torch.Tensor]:  # sampled [N], policy [N]
    """Log-prob of each token under the distribution it was sampled from (`sampling_probs`: greedy rows
    give 0) and under the untempered policy (log_softmax of the raw logits)."""
    index = tokens.view(-1, 1).to(logits.device)
    sampled = sampling_probs(logits, temperature, top_k, top_p, min_p).gather(-1, index).squeeze(-1).log()
    raw = logits if policy_logits is None else policy_logits
    policy = torch.log_softmax(raw.float(), dim=-1).gather(-1, index).squeeze(-1)
    return sampled, policy
