"""Distillation losses for learned drafters: draft logits over a reduced vocabulary vs the target.

A drafter with a reduced vocabulary (`draft_to_target` [Vd] maps draft ids to target ids) can only
propose in-vocabulary tokens. We therefore compare the draft against the target distribution
*restricted to the draft vocabulary and renormalised*: p'(i) = p(d2t[i]) / sum_j p(d2t[j]). That is the
best the draft can do (its acceptance on out-of-vocabulary mass is 0 whatever it outputs), and it equals
softmax over the restricted target logits, so the full [N, V] target distribution is never needed.
`in_vocab_mass` reports what was dropped (an upper bound on the per-token acceptance probability).

Soft cross-entropy H(p', q) and forward KL(p' || q) = H(p', q) - H(p') differ by a constant of the
target, so they share gradients; training minimises the former, `forward_kl` is the number to report.

`soft_cross_entropy_reference` is the obvious autograd version; `soft_cross_entropy` is the fused one
(a custom autograd function, optionally in row chunks: backward keeps only [N] row statistics (logsumexp
and target mass) instead of autograd's [N, Vd] log-softmax, and rebuilds the gradient
(softmax(z) * sum(p) - p) * w in place). They agree in value and gradient (tests/ops/test_losses.py).
On the 2-core CPU its time is at parity with the reference (fwd+bwd of [4096, 8192]: ~0.29-0.35 s vs
~0.26-0.32 s, noisy shared machine); the gain is memory.
"""
from __future__ import annotations

import torch

CHUNK_ROWS = 4096  # rows per chunk of the fused loss: bounds its temporary [chunk, Vd] buffers


def restricted_target_probs(
    target_logits: torch.Tensor,  # [N, V] target logits over its full vocabulary
    draft_to_target: torch.Tensor,  # [Vd] long
    temperature: float = 1.0,
) -> torch.Tensor:  # [N, Vd], rows sum to 1
    """The target distribution restricted to the draft vocabulary and renormalised."""
    return torch.softmax(target_logits.float().index_select(-1, draft_to_target) / temperature, dim=-1)


def in_vocab_mass(
    target_logits: torch.Tensor,  # [N, V]
    draft_to_target: torch.Tensor,  # [Vd] long
) -> torch.Tensor:  # [N]: target probability mass inside the draft vocabulary
    log_probs = torch.log_softmax(target_logits.float(), dim=-1)
    return log_probs.index_select(-1, draft_to_target).exp().sum(-1)


def soft_cross_entropy_reference(
    draft_logits: torch.Tensor,  # [N, Vd]
    target_probs: torch.Tensor,  # [N, Vd], rows sum to 1 (or less: mass outside is ignored)
    weights: torch.Tensor | None = None,  # [N] per-row weights (0 = masked); None = all 1
) -> torch.Tensor:  # scalar: sum_n w_n * H(p_n, q_n) / sum_n w_n
    per_row = -(target_probs * torch.log_softmax(_at_least_fp32(draft_logits), dim=-1)).sum(-1)  # [N]
    weights = torch.ones_like(per_row) if weights is None else weights.to(per_row.dtype)
    return (per_row * weights).sum() / weights.sum().clamp_min(1e-12)


class _FusedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_logits, target_probs, weights):  # [N, Vd], [N, Vd], [N]
        norm = weights.sum().clamp_min(1e-12)
        lse = torch.empty(draft_logits.shape[0], dtype=_at_least_fp32(weights).dtype)  # [N], kept for backward
        mass = torch.empty_like(lse)  # [N] sum of p per row, kept for backward
        total = lse.new_zeros(())
        for rows in _chunks(draft_logits.shape[0]):
            z, p = _at_least_fp32(draft_logits[rows]), _at_least_fp32(target_probs[rows])
            lse[rows] = torch.logsumexp(z, dim=-1)
            mass[rows] = p.sum(-1)
            per_row = lse[rows] * mass[rows] - torch.linalg.vecdot(p, z)  # H(p, softmax(z)) without a log-softmax buffer
            total = total + (per_row * weights[rows]).sum()
        ctx.save_for_backward(draft_logits, target_probs, weights, lse, mass)
        ctx.norm = norm
        return total / norm

    @staticmethod
    def backward(ctx, grad_out):
        draft_logits, target_probs, weights, lse, mass = ctx.saved_tensors
        scale = weights * (grad_out / ctx.norm)  # [N]
        chunks = _chunks(draft_logits.shape[0])
        grad = None if len(chunks) == 1 else torch.empty_like(draft_logits)
        for rows in chunks:
            z, p = _at_least_fp32(draft_logits[rows]), _at_least_fp32(target_probs[rows])
            g = torch.exp(z - lse[rows].unsqueeze(-1))  # softmax(z) from the forward's normaliser
            g.mul_((mass[rows] * scale[rows]).unsqueeze(-1)).addcmul_(p, -scale[rows].unsqueeze(-1))  # (softmax * sum p - p) * w
            if grad is None:
                return g.to(draft_logits.dtype), None, None  # one chunk: no copy
            grad[rows] = g
        return grad, None, None


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + CHUNK_ROWS, n)) for i in range(0, n, CHUNK_ROWS)]


def soft_cross_entropy(
    draft_logits: torch.Tensor,  # [N, Vd]
    target_probs: torch.Tensor,  # [N, Vd]; no gradient flows into the target
    weights: torch.Tensor | None = None,  # [N]; None = all 1
) -> torch.Tensor:  # scalar, equal to soft_cross_entropy_reference
    """Fused soft cross-entropy: same value and gradient as the reference, less memory."""
    if weights is None:
        weights = draft_logits.new_ones(draft_logits.shape[0])
    return _FusedSoftCE.apply(draft_logits, target_probs.detach(), _at_least_fp32(weights.detach()))


def forward_kl(
    draft_logits: torch.Tensor,  # [N, Vd]
    target_probs: torch.Tensor,  # [N, Vd], rows sum to 1
    weights: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # scalar: weighted mean of KL(p || q) = H(p, q) - H(p)
    entropy = -(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1)  # [N]
    weights = torch.ones_like(entropy) if weights is None else weights.to(entropy.dtype)
    mean_entropy = (entropy * weights).sum() / weights.sum().clamp_min(1e-12)
    return soft_cross_entropy(draft_logits, target_probs, weights) - mean_entropy


def top1_agreement(
    draft_logits: torch.Tensor,  # [N, Vd]
    target_probs: torch.Tensor,  # [N, Vd]
    weights: torch.Tensor | None = None,  # [N] 0/1 mask
) -> tuple[int, int]:  # (rows where both argmaxes agree, rows counted)
    agree = draft_logits.argmax(-1) == target_probs.argmax(-1)
    mask = torch.ones_like(agree) if weights is None else weights > 0
    return int((agree & mask).sum()), int(mask.sum())


def rejection_probability(
    target_prob: torch.Tensor,  # [N] p(x): the target's (sampling) probability of each drafted token
    draft_prob: torch.Tensor,  # [N] q(x): the probability the drafter drew it with (1 = deterministic)
) -> torch.Tensor:  # [N] r = 1 - min(1, p/q): the chance the verifier rejects x
    return 1.0 - torch.clamp(target_prob / draft_prob.clamp_min(1e-12), max=1.0)


def drafting_log_complement(
    draft_logits: torch.Tensor,  # [N, Vd] the draft's logits where each token was proposed
    tokens: torch.Tensor,  # [N] long: the proposed tokens (draft-vocabulary ids)
    temperature: torch.Tensor | None = None,  # [N] the request's temperature; 0 or None: the T = 1 softmax
    top_k: torch.Tensor | None = None,  # [N] long; 0 = off
    top_p: torch.Tensor | None = None,  # [N]; 1.0 = off
) -> torch.Tensor:  # [N] log(1 - q_theta(x)), differentiable in the logits
    """log(1 - q(x)) under the distribution the drafter samples from: softmax(z / T) over the top-k/top-p
    set (the set is a function of the logits' order, held fixed: no gradient through it). Greedy rows
    (T = 0, deterministic drafting) use the T = 1 softmax as their smooth surrogate. Computed as
    logsumexp over the other kept tokens minus logsumexp over all kept ones, finite as q(x) -> 1; a token
    outside the set has q = 0 (value 0), and a set holding x alone has q = 1 with no direction to move
    mass within it (value 0, zero gradient)."""
    z = _at_least_fp32(draft_logits)
    if temperature is not None:
        t = temperature.to(z.dtype)
        z = z / torch.where(t > 0, t, torch.ones_like(t)).unsqueeze(-1)
        if top_k is not None and top_p is not None and bool(((top_k > 0) | (top_p < 1.0)).any()):
            from tandem.ops.sampling import _mask_top_k_top_p

            kept = torch.isfinite(_mask_top_k_top_p(z.detach(), top_k, top_p))
            z = z.masked_fill(~kept, float("-inf"))
    others = z.scatter(1, tokens.view(-1, 1), float("-inf"))
    alone = ~torch.isfinite(others).any(-1)  # [N] x is the only token in the set
    others = torch.where(alone.unsqueeze(-1), torch.zeros_like(others), others)
    log_not_x = torch.logsumexp(others, dim=-1) - torch.logsumexp(z, dim=-1)
    return torch.where(alone, torch.zeros_like(log_not_x), log_not_x)


def discard_loss(
    draft_logits: torch.Tensor,  # [N, Vd] the draft's logits where each token was proposed
    tokens: torch.Tensor,  # [N] long: the proposed tokens (draft-vocabulary ids)
    weights: torch.Tensor,  # [N] r, the rejection probability (no gradient)
    temperature: torch.Tensor | None = None,  # [N] sampling transform the drafter drew with (see drafting_log_complement)
    top_k: torch.Tensor | None = None,  # [N]
    top_p: torch.Tensor | None = None,  # [N]
    normaliser: float | None = None,  # divide the sum by this (default N)
) -> torch.Tensor:  # scalar: sum_n r_n * -log(1 - q_theta(x_n)) / normaliser  (0 for N = 0)
    """Unlikelihood on proposals the verifier may discard: pushes probability off each token in
    proportion to its rejection probability r (tandem/flywheel/objective.py derives the estimator: one term per
    *evaluated* proposal, weighted by r once)."""
    if tokens.numel() == 0:
        return draft_logits.sum() * 0.0
    log_not_x = drafting_log_complement(draft_logits, tokens, temperature, top_k, top_p)
    total = -(weights.detach().to(log_not_x.dtype) * log_not_x).sum()
    return total / (tokens.numel() if normaliser is None else normaliser)