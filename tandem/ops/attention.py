"""Attention of a few new queries over a read-only cached prefix plus the new keys (no cache write).

What the compiled forward uses: the KV cache is only read inside the graph (an in-graph write into a
graph input made inductor copy the whole cache every step), and the new K/V are written by the caller
afterwards. Scores over [prefix | new] are softmaxed together, so this is exactly SDPA over the
concatenated keys, without materialising the concatenation.
"""
from __future__ import annotations

import math

import torch


def prefix_attention(
    q: torch.Tensor,  # [B, T, H, D] new queries
    k_new: torch.Tensor,  # [B, T, Hkv, D]
    v_new: torch.Tensor,  # [B, T, Hkv, D]
    k_prefix: torch.Tensor,  # [B, Hkv, S, D] cached keys (slots 0..S-1, maybe not all valid)
    v_prefix: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B, 1, T, S + T] bool, True = attend (prefix slots, then the new tokens)
) -> torch.Tensor:  # [B, T, H * D]
    b, t, heads, dim = q.shape
    kv_heads, s = k_prefix.shape[1], k_prefix.shape[2]
    group = heads // kv_heads  # query head h reads kv head h // group
    qg = q.permute(0, 2, 1, 3).reshape(b, kv_heads, group * t, dim) * (1.0 / math.sqrt(dim))  # [B, Hkv, G*T, D]
    k_new, v_new = k_new.transpose(1, 2), v_new.transpose(1, 2)  # [B, Hkv, T, D]
    scores = torch.cat([qg @ k_prefix.transpose(-1, -2), qg @ k_new.transpose(-1, -2)], dim=-1)  # [B, Hkv, G*T, S+T]
    allowed = mask.unsqueeze(2).expand(b, 1, group, t, s + t).reshape(b, 1, group * t, s + t)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = probs[..., :s] @ v_prefix + probs[..., s:] @ v_new  # [B, Hkv, G*T, D]
    return out.view(b, kv_heads, group, t, dim).reshape(b, heads, t, dim).transpose(1, 2).reshape(b, t, heads * dim)
