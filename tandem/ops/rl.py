"""Pure math of GRPO as practitioners run it: advantages, the clipped objective with its options, KL.

Loss aggregation (`agg`), as the GRPO variants define it, for a batch of S samples with n_s tokens each:
- "seq_mean_token_mean" (GRPO): mean over samples of each sample's token mean.
- "token_mean" (DAPO): sum over every token of the batch / the batch's token count.
- "seq_mean_token_sum_norm" (Dr. GRPO): sum over every token / (S * max_tokens), a constant divisor.
`policy_loss` returns the numerator summed over the tokens it is given, already weighted per token for
`agg`; the caller divides by `aggregation_divisor` of the *whole* batch, so micro-batches, mini-batches
and skipped samples never change the divisor.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def group_advantages(
    rewards: torch.Tensor,  # [N]
    groups: torch.Tensor,  # [N] long: group (prompt) id of each sample
    eps: float = 1e-4,
    scale_by_std: bool = True,  # False: Dr. GRPO's r - mean(group)
) -> torch.Tensor:  # [N]: (r - mean of its group) / (std of its group + eps); 0 for a group with equal rewards
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        member = groups == g
        r = rewards[member]
        std = r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(())
        centered = r - r.mean()
        scaled = centered / (std + eps) if scale_by_std else centered
        out[member] = torch.where(std > 0, scaled, torch.zeros_like(centered))
    return out


def token_weights(
    sample_of: torch.Tensor,  # [M] long: sample of each token
    lengths: torch.Tensor,  # [S] tokens of each sample (the whole sample, also where only part of it is given)
    agg: str,
) -> torch.Tensor:  # [M]: what each token's loss is multiplied by before the sum (the divisor comes later)
    if agg == "seq_mean_token_mean":
        return 1.0 / lengths.clamp(min=1).to(torch.float32)[sample_of]
    if agg in ("token_mean", "seq_mean_token_sum_norm"):
        return torch.ones(sample_of.shape, dtype=torch.float32)
    raise ValueError(f"unknown loss aggregation {agg!r}; one of {AGGREGATIONS}")


def aggregation_divisor(lengths: list[int], agg: str, max_tokens: int) -> float:
    """The whole batch's divisor: samples (GRPO), tokens (DAPO) or samples x max_tokens (Dr. GRPO)."""
    if agg == "seq_mean_token_mean":
        return float(len(lengths))
    if agg == "token_mean":
        return float(max(1, sum(lengths)))
    if agg == "seq_mean_token_sum_norm":
        return float(len(lengths) * max_tokens)
    raise ValueError(f"unknown loss aggregation {agg!r}; one of {AGGREGATIONS}")


def k3_kl(
    new_logprobs: torch.Tensor,  # [M] learner log-probs (differentiable)
    ref_logprobs: torch.Tensor,  # [M] the frozen reference policy's
) -> torch.Tensor:  # [M]: exp(ref - new) - (ref - new) - 1 >= 0, an unbiased estimate of KL(new || ref)
    log_ratio = ref_logprobs - new_logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def policy_loss(
    new_logprobs: torch.Tensor,  # [M] learner log-probs of the sampled tokens (differentiable)
    behaviour_logprobs: torch.Tensor,  # [M] log-probs under the distribution the rollout sampled from
    advantages: torch.Tensor,  # [M] the token's sample advantage
    weights: torch.Tensor,  # [M] token_weights(...) for the aggregation
    clip_low: float,  # ratio clipped to [1 - clip_low, 1 + clip_high] (clip-higher: clip_high > clip_low)
    clip_high: float,
    proximal_logprobs: torch.Tensor | None = None,  # [M] the learner's own (no grad) before this update: decoupled PPO
    behaviour_cap: float = 5.0,  # the behaviour importance weight exp(prox - behaviour) is truncated here
    ref_logprobs: torch.Tensor | None = None,  # [M] frozen reference for the KL term
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict]:  # (sum over tokens of weight * loss, stats)
    """-min(ratio * A, clip(ratio) * A) per token, plus kl_coef * k3.

    Standard PPO anchors the ratio to the behaviour policy: ratio = exp(new - behaviour). With
    `proximal_logprobs` (AReaL's decoupled objective, for samples from an older policy) the ratio is
    exp(new - proximal), so the trust region is around the learner's current policy, and each token is
    weighted by the truncated importance weight min(exp(proximal - behaviour), behaviour_cap), which corrects
    for the samples' having come from the behaviour policy. With proximal == behaviour both are the same.
    """
    anchor = behaviour_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(new_logprobs - anchor)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    importance = torch.ones_like(ratio)
    if proximal_logprobs is not None:
        importance = torch.exp(proximal_logprobs - behaviour_logprobs).clamp(max=behaviour_cap).detach()
        per_token = per_token * importance
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = k3_kl(new_logprobs, ref_logprobs)
        per_token = per_token + kl_coef * kl
    with torch.no_grad():
        out_of_range = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        n = max(1, ratio.numel())
        stats = {
            "tokens": ratio.numel(),
            "ratio_sum": float(ratio.sum()), "ratio_max": float(ratio.max()) if ratio.numel() else 1.0,
            "clipped_tokens": int(out_of_range.sum()),
            "kl_sum": float(kl.sum()) if kl is not None else 0.0,
            "importance_mean": float(importance.sum()) / n,
        }
    return (per_token * weights).sum(), stats


def entropy_sum(logits: torch.Tensor) -> float:  # [M, V] -> summed per-token entropy of softmax(logits), no grad
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), -1)
        return float(-(logp.exp() * logp).sum())


def clipped_policy_loss(
    new_logprobs: torch.Tensor,  # [M]
    old_logprobs: torch.Tensor,  # [M]
    advantages: torch.Tensor,  # [M]
    sample_of: torch.Tensor,  # [M] long, in [0, S)
    num_samples: int,  # S
    clip_eps: float,
) -> tuple[torch.Tensor, dict]:  # summed per-sample token means (divide by the batch's sample count), stats
    """GRPO's symmetric clip, per-sample token means summed over samples (the "seq_mean_token_mean" numerator)."""
    lengths = torch.bincount(sample_of, minlength=num_samples)
    weights = token_weights(sample_of, lengths, "seq_mean_token_mean")
    loss, stats = policy_loss(new_logprobs, old_logprobs, advantages, weights, clip_eps, clip_eps)
    n = max(1, stats["tokens"])
    return loss, {"ratio_mean": stats["ratio_sum"] / n if stats["tokens"] else 1.0, "clip_fraction": stats["clipped_tokens"] / n}
