"""The EAGLE head's training forward: the training-time-test unroll and the passes the flywheel loss builds on it.

`unroll_states` runs the head's layer as drafting would chain it (step s reads step s-1's hidden state in place
of a target feature) over every root of a sequence at once; `entry_context` / `forward_on` run the layer at new
entries (branch nodes) over keys and values computed elsewhere; `lm_head_rows` projects many tensors of normed
hidden states in one GEMM. Serving (cached steps, draft trees) is EagleHead.forward in tandem.models.eagle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.models.eagle import EagleHead


def unroll_mask(roots: torch.Tensor, num_tokens: int, step: int, segment: torch.Tensor | None = None) -> torch.Tensor:  # [R, T + step R] bool
    """Training-time-test attention at unroll step s for chains rooted at `roots` [R]: causal over the T
    target-feature entries (up to the root; with `segment` [T], only the root's own segment's), then each chain
    sees only its own entries from steps 1..s (one per step, on the diagonal)."""
    causal = torch.arange(num_tokens).unsqueeze(0) <= roots.unsqueeze(1)
    if segment is not None:
        causal &= segment.unsqueeze(0) == segment[roots].unsqueeze(1)
    return torch.cat([causal] + [torch.eye(len(roots), dtype=torch.bool)] * step, dim=1)


def unroll(head: EagleHead, *args, **kwargs) -> list[torch.Tensor]:
    """`unroll_states` without the step-0 context."""
    return unroll_states(head, *args, **kwargs)[0]


def unroll_states(
    head: EagleHead,
    input_ids: torch.Tensor,  # [B, T + steps - 1]: x_1 .. (token t+1 pairs with feature t)
    fused: torch.Tensor,  # [B, T, d] fused target features f_0 .. f_{T-1}
    steps: int,
    chain_roots: torch.Tensor | None = None,  # [R] increasing: roots whose chains go past step 0; None = all T
    first_roots: torch.Tensor | None = None,  # [R0]: roots whose step-0 logits are wanted; None = all T
    project: bool = True,  # False: the normed hidden states [.., d] the LM head would read, for one LM-head pass over many (lm_head_rows)
    segment: torch.Tensor | None = None,  # [T]: sequences packed end to end (B = 1); a chain attends within its root's segment only
    positions: torch.Tensor | None = None,  # [T + steps - 1] RoPE position of each entry (packed: within its segment); None: the index
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Training-time test: step s feeds step s-1's hidden states back in place of target features.

    Step 0 projects keys and values at every position (the context of every chain); later steps are
    independent per chain, so training may unroll only a sample of roots (`chain_roots`) and read
    step-0 logits at a subset (`first_roots`, e.g. the generated part only). Given both, step 0's
    queries, attention output and MLP run only at the rows read afterwards (their union): the rows of a
    prompt feed keys and values and nothing else, so the result and its gradient are the same.

    Returns the outputs per step ([B, T or R0, Vd], then steps-1 x [B, R, Vd]: step s at root t predicts
    x_{t+s+2}; normed hidden states instead of logits with project=False) and step 0's keys and values
    at every entry ([B, Hkv, T, D] each: the context `forward_on` extends, e.g. with branch nodes).
    """
    t = fused.shape[1]
    roots = torch.arange(t)
    read = torch.unique(torch.cat([first_roots.cpu(), chain_roots.cpu()])) if first_roots is not None and chain_roots is not None else None
    keys, values, logits = [], [], []
    features = fused
    for step in range(steps):
        if step == 1 and chain_roots is not None:
            roots = chain_roots.cpu()
            at = roots if read is None else torch.searchsorted(read, roots)
            features = features[:, at.to(features.device)]
        index = (roots + step).to(fused.device)
        cos, sin = head.rope((index if positions is None else positions[index]).unsqueeze(0))
        q, k, v = head.attn.project(head.layer_input(input_ids[:, index], features), cos, sin)
        keys.append(k.transpose(1, 2))
        values.append(v.transpose(1, 2))
        mask = unroll_mask(roots, t, step, segment)
        group = None if segment is None else segment[roots]  # each query's trace: attention runs trace by trace
        if step == 0 and read is not None:
            q, mask, features = q[:, read.to(q.device)], mask[read], features[:, read.to(features.device)]
            group = None if group is None else group[read]
        features = head.residual(features, attend_within(head, q, torch.cat(keys, 2), torch.cat(values, 2), mask.to(fused.device), group))
        wanted = features
        if step == 0 and first_roots is not None:
            wanted = features[:, (first_roots.cpu() if read is None else torch.searchsorted(read, first_roots.cpu())).to(features.device)]
        normed = head.norm(wanted)
        logits.append(head.lm_head(normed) if project else normed)
    return logits, (keys[0], values[0])


def entry_context(head: EagleHead, input_ids: torch.Tensor, fused: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, Hkv, T, D] of T entries (token x_{t+1} with fused feature f_t at position t): the
    context other entries attend to, as step 0 of `unroll_states` computes it."""
    cos, sin = head.rope(positions)
    _, k, v = head.attn.project(head.layer_input(input_ids, fused), cos, sin)
    return k.transpose(1, 2), v.transpose(1, 2)


def forward_on(
    head: EagleHead,
    context: tuple[torch.Tensor, torch.Tensor],  # keys, values [1, Hkv, C, D] of entries computed elsewhere
    input_ids: torch.Tensor,  # [1, N] the new entries
    fused: torch.Tensor,  # [1, N, d]
    positions: torch.Tensor,  # [1, N]
    mask: torch.Tensor,  # [N, C + N] bool: which context entries and new entries each new entry sees
    group: torch.Tensor | None = None,  # [N] nondecreasing: entries of different groups see disjoint keys (attend_within)
) -> torch.Tensor:  # hidden [1, N, d]
    """The layer at N new entries over a context of C entries whose keys and values exist already: the
    context costs nothing here, and its gradient flows into whatever computed it."""
    cos, sin = head.rope(positions)
    q, k, v = head.attn.project(head.layer_input(input_ids, fused), cos, sin)
    keys, values = torch.cat([context[0], k.transpose(1, 2)], 2), torch.cat([context[1], v.transpose(1, 2)], 2)
    return head.residual(fused, attend_within(head, q, keys, values, mask, group))


def attend_within(head: EagleHead, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, group: torch.Tensor | None) -> torch.Tensor:  # [1, R, d]
    """The head's attention of queries q [1, R, H, D] over keys, values [1, Hkv, C, D] under mask [R, C]; with `group`
    [R] (nondecreasing: traces or documents packed end to end), each group's queries attend over only the columns one
    of them sees. Packed sequences see none of each other's keys, so the masked product over all C columns is mostly
    zeros: at 4 flywheel traces a block per group does ~1/4 of the work, with the same result up to float rounding."""
    if group is None or len(group) == 0 or bool(group[0] == group[-1]):
        return head.attn.attend(q, keys, values, mask.view(1, 1, *mask.shape), False)
    parts, start = [], 0
    for count in torch.unique_consecutive(group, return_counts=True)[1].tolist():
        rows = slice(start, start + count)
        cols = mask[rows].any(0).nonzero().flatten()
        parts.append(head.attn.mix(q[:, rows], keys[:, :, cols], values[:, :, cols], mask[rows][:, cols].view(1, 1, count, len(cols)), False))
        start += count
    return head.attn.o(torch.cat(parts, 1))


def lm_head_rows(head: EagleHead, normed: list[torch.Tensor]) -> list[torch.Tensor]:  # [..., d] each -> [..., Vd] each
    """The LM head over many tensors of normed hidden states in one GEMM: the 16k x d weight is read once
    instead of once per tensor (at a few dozen rows a call, an LM-head call streams the weight from memory
    and costs ~8x its arithmetic), in the forward and again in the backward."""
    rows = torch.cat([h.reshape(-1, h.shape[-1]) for h in normed])
    out = head.lm_head(rows).split([h[..., 0].numel() for h in normed])
    return [o.view(*h.shape[:-1], o.shape[-1]) for o, h in zip(out, normed)]
