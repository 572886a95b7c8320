"""What a verify forward is fed: each request's pending token followed by its draft, padded or ragged.

Padded (`padded_inputs`): ids / positions [B, T] and a tree mask [B, T, T], every row as wide as the widest draft;
what the model's generic forward (SDPA, torch.compile) takes. Ragged (`ragged_inputs`): the rows one after another
as one column of N = sum(1 + len(draft)) tokens, so a row that drafts nothing costs one token
(Transformer.forward_ragged, on the fused CPU path). `pad_output` turns a ragged forward's output back into the
padded layout the verifier, the drafters and the observers read ([B, T, ...], positions past a row's draft unset).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.transformer import ForwardOutput
from tandem.ops import tree as tree_ops
from tandem.types import DraftTree


def _positions(start: int, draft: DraftTree) -> torch.Tensor:  # [1 + N]: the root, then each node at its depth
    return start + torch.cat([torch.zeros(1, dtype=torch.long), 1 + tree_ops.depths(draft.parents)])


def _tree_masks(drafts: list[DraftTree], width: int) -> torch.Tensor:  # [B, width, width]
    return tree_ops.batch_tree_attention_mask([torch.cat([torch.tensor([-1]), d.parents + 1]) for d in drafts], width)


def padded_inputs(pending: list[int], drafts: list[DraftTree], starts: list[int]):
    """Token ids [B, T], positions [B, T] and a tree mask [B, T, T] (None when all are chains of one length)."""
    width = 1 + max(len(d) for d in drafts)
    if all(len(d) == width - 1 and d.is_chain for d in drafts):  # plain decoding, or chains of one length: no per-row work
        ids = torch.cat([torch.tensor(pending, dtype=torch.long).unsqueeze(1), *([torch.stack([d.tokens for d in drafts])] if width > 1 else [])], dim=1)
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(width)
        return ids, positions, None
    ids = torch.zeros(len(drafts), width, dtype=torch.long)
    positions = torch.zeros(len(drafts), width, dtype=torch.long)
    for b, (token, draft) in enumerate(zip(pending, drafts)):
        n = len(draft)
        ids[b, 0] = token
        ids[b, 1 : n + 1] = draft.tokens
        positions[b, : n + 1] = _positions(starts[b], draft)
        positions[b, n + 1 :] = starts[b] + torch.arange(n + 1, width)
    return ids, positions, _tree_masks(drafts, width)


@dataclass(frozen=True)
class RaggedInputs:
    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    lengths: list[int]  # [B] 1 + len(draft) per row
    tree: torch.Tensor | None  # [N, max(lengths)] bool; None when every draft is a chain (causal within each row)


def ragged_inputs(pending: list[int], drafts: list[DraftTree], starts: list[int]) -> RaggedInputs:
    lengths = [1 + len(d) for d in drafts]
    ids = torch.cat([torch.cat([torch.tensor([token]), d.tokens]) for token, d in zip(pending, drafts)])
    positions = torch.cat([_positions(start, d) for start, d in zip(starts, drafts)])
    tree = None
    if not all(d.is_chain for d in drafts):
        masks = _tree_masks(drafts, max(lengths))
        tree = torch.cat([masks[b, :n] for b, n in enumerate(lengths)])
    return RaggedInputs(ids, positions, lengths, tree)


def pad_output(out: ForwardOutput, lengths: list[int]) -> ForwardOutput:
    """A ragged forward's output ([N, 1, ...]) as [B, max(lengths), ...]: row b's tokens at positions 0..lengths[b]-1;
    the positions past them are zero (hidden states) or unset (logits, the one large tensor: nothing reads them, a
    verify reads a row's own 1 + len(draft) positions)."""
    width = max(lengths)
    index = torch.cat([b * width + torch.arange(n) for b, n in enumerate(lengths)])

    def pad(x: torch.Tensor | None, fill: bool = True) -> torch.Tensor | None:
        if x is None:
            return None
        shape = (len(lengths) * width, *x.shape[2:])
        padded = x.new_zeros(shape) if fill else x.new_empty(shape)
        padded[index] = x[:, 0]
        return padded.view(len(lengths), width, *x.shape[2:])

    return ForwardOutput(pad(out.logits, fill=False), tuple(pad(h) for h in out.hidden), pad(out.final_hidden))
