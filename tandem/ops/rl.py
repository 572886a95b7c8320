"""Pure math of GRPO: group-relative advantages and the clipped (PPO-style) policy objective."""
from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,  # [N]
    groups: torch.Tensor,  # [N] long: group (prompt) id of each sample
    eps: float = 1e-4,
) -> torch.Tensor:  # [N]: (r - mean of its group) / (std of its group + eps); 0 for a group with equal rewards
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        member = groups == g
        r = rewards[member]
        std = r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(())
        centered = r - r.mean()
        out[member] = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return out


def clipped_policy_loss(
    new_logprobs: torch.Tensor,  # [M] learner log-probs of the sampled tokens (differentiable)
    old_logprobs: torch.Tensor,  # [M] behaviour log-probs (the distribution the rollout sampled from)
    advantages: torch.Tensor,  # [M] the token's sample advantage
    sample_of: torch.Tensor,  # [M] long: which sample each token belongs to, in [0, S)
    num_samples: int,  # S
    clip_eps: float,
) -> tuple[torch.Tensor, dict]:  # summed per-sample token means (divide by the batch's sample count), stats
    """-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) with ratio = exp(new - old) (the importance
    weight of the behaviour policy), averaged over each sample's tokens and summed over samples."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    counts = torch.bincount(sample_of, minlength=num_samples).clamp(min=1).to(per_token.dtype)
    per_sample = torch.zeros(num_samples, dtype=per_token.dtype).index_add(0, sample_of, per_token) / counts
    with torch.no_grad():
        stats = {
            "ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
            "clip_fraction": float(((ratio - 1).abs() > clip_eps).float().mean()) if ratio.numel() else 0.0,
        }
    return per_sample.sum(), stats
