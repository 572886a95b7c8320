"""The training-time-test unroll over packed rows, vectorised over positions.

A packed row holds several documents end to end (segment ids). Step 0 runs the draft layer over every
position with attention causal *within* each document. Steps 1..S-1 continue a sample of chains (the
same root positions in every row): the query of chain r at step s sees the step-0 keys of its document
up to r, plus its own keys from steps 1..s, one per step. Instead of a [R, L + s R] mask that is almost
all False, the own-chain scores are computed as s dot products per query and concatenated to the
[R, L] scores before one softmax: memory O(R L), not O(s R L). `eagle_train.unroll` is the reference (one
unpacked sequence, explicit masks); tests/training/test_packed.py checks they agree.

Indexing as in tandem.models.eagle: at step s the chain rooted at t reads token x_{t+s+1} and predicts
x_{t+s+2}, whose target distribution is the target's final hidden state at position t+s+1.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.models.cpu_gemm import product_nt
from tandem.models.eagle import EagleHead
from tandem.ops.losses import soft_cross_entropy
from tandem.training.features import PackedBatch


def step0_mask(segment: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, 1, L, L] bool
    """Causal within a document; padding (segment 0) attends to itself only, so no row is empty."""
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    return (causal & same).unsqueeze(1)


def next_valid(segment: torch.Tensor, offset: int) -> torch.Tensor:  # [B, L] bool
    """Position t has a position t + offset in the same (non-pad) document."""
    if offset >= segment.shape[1]:
        return torch.zeros_like(segment, dtype=torch.bool)
    ahead = torch.zeros_like(segment)
    ahead[:, : segment.shape[1] - offset] = segment[:, offset:]
    return (segment > 0) & (ahead == segment)


def shifted(x: torch.Tensor, offset: int) -> torch.Tensor:  # [B, L, ...] -> x[:, t + offset] (zeros past the end)
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - offset] = x[:, offset:]
    return out


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, Hkv, N, D] -> [B, H, N, D]
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def chain_attention(
    q: torch.Tensor,  # [B, H, R, D] queries of chains at step s
    keys0: torch.Tensor,  # [B, H, L, D] step-0 keys (already expanded to H)
    values0: torch.Tensor,  # [B, H, L, D]
    mask0: torch.Tensor,  # [B, 1, R, L] bool: which step-0 keys each chain sees
    own_keys: list[torch.Tensor],  # s x [B, H, R, D]: the chain's own keys at steps 1..s
    own_values: list[torch.Tensor],
) -> torch.Tensor:  # [B, H, R, D]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores0 = (q @ keys0.transpose(-1, -2)) * scale
    scores0 = scores0.masked_fill(~mask0, float("-inf"))
    own = [(q * k).sum(-1, keepdim=True) * scale for k in own_keys]  # s x [B, H, R, 1]
    probs = torch.softmax(torch.cat([scores0] + own, dim=-1), dim=-1)
    length = keys0.shape[2]
    out = probs[..., :length] @ values0
    for j, v in enumerate(own_values):
        out = out + probs[..., length + j : length + j + 1] * v
    return out


def packed_unroll(
    head: EagleHead,
    batch: PackedBatch,
    steps: int,
    roots: torch.Tensor | None,  # [R] positions continued past step 0 (same in every row); None = all
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # hidden per step ([B, L, d], then [B, R, d]); root index per step
    """The head's output hidden states at every unroll step (logits are left to the loss, which may chunk)."""
    cfg = head.attn.cfg
    b, length = batch.tokens.shape
    heads = cfg.num_heads
    fed = shifted(batch.tokens, 1)  # x_{t+1}
    features = head.fuse([batch.taps.float()])  # [B, L, d]
    cos, sin = head.rope(batch.position)
    q, k, v = head.attn.project(head.layer_input(fed, features), cos, sin)
    keys0, values0 = _expand_kv(k.transpose(1, 2), heads), _expand_kv(v.transpose(1, 2), heads)
    mask = step0_mask(batch.segment)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys0, values0, attn_mask=mask)
    hidden = head.residual(features, head.attn.o(attn.transpose(1, 2).reshape(b, length, cfg.q_size)))
    outputs, indices = [hidden], [torch.arange(length)]
    roots = torch.arange(length) if roots is None else roots
    mask_r = mask[:, :, roots]  # [B, 1, R, L]
    own_k, own_v = [], []
    features = hidden[:, roots]
    for s in range(1, steps):
        cos, sin = head.rope(batch.position[:, roots] + s)
        tokens = shifted(batch.tokens, s + 1)[:, roots]  # x_{t+s+1}
        q, k, v = head.attn.project(head.layer_input(tokens, features), cos, sin)
        own_k.append(_expand_kv(k.transpose(1, 2), heads))
        own_v.append(_expand_kv(v.transpose(1, 2), heads))
        attn = chain_attention(q.transpose(1, 2), keys0, values0, mask_r, own_k, own_v)
        features = head.residual(features, head.attn.o(attn.transpose(1, 2).reshape(b, len(roots), cfg.q_size)))
        outputs.append(features)
        indices.append(roots)
    return outputs, indices


def packed_loss(
    head: EagleHead,
    target_rows: torch.Tensor,  # [Vd, d] the target's LM-head rows of the draft vocabulary (frozen)
    batch: PackedBatch,
    steps: int,
    roots: torch.Tensor | None,
    answer_only: bool = True,
    step_weight: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """Weighted mean over steps of the soft cross-entropy against the target distribution restricted to the
    draft vocabulary, step s weighted step_weight**s (1.0: the plain mean; EAGLE-3 uses 0.8); stats: per-step
    top-1 agreement with the target's draft-vocabulary argmax and row counts."""
    outputs, indices = packed_unroll(head, batch, steps, roots)
    weights = [step_weight**s for s in range(steps)]
    total, stats = 0.0, {"correct": [], "counted": []}
    for s, (hidden, index) in enumerate(zip(outputs, indices)):
        valid = next_valid(batch.segment, s + 1)[:, index]  # [B, R]: position t+s+1 exists in t's document
        if answer_only:
            valid &= shifted(batch.answer, s + 1)[:, index]  # the token predicted (x_{t+s+2}) is answer text
        rows = valid.reshape(-1)
        final = shifted(batch.final, s + 1)[:, index].reshape(-1, batch.final.shape[-1])[rows]
        logits = head.lm_head(head.norm(hidden.reshape(-1, hidden.shape[-1])[rows]))
        with torch.no_grad():
            target_probs = torch.softmax(product_nt(final.float(), target_rows), dim=-1)
        total = total + weights[s] * (soft_cross_entropy(logits, target_probs) if rows.any() else logits.sum() * 0.0)
        stats["correct"].append(int((logits.detach().argmax(-1) == target_probs.argmax(-1)).sum()))
        stats["counted"].append(int(rows.sum()))
    return total / sum(weights), stats
