"""`mtp`: Medusa-style heads on the target's final hidden state draft k tokens at once.

State per cache row: the target's final hidden state at the last committed position (the one that
predicted the pending token), taken from on_prefill's prompt forward and from on_verified's last accepted
path node. One head forward per step drafts the whole chain: head i's argmax (greedy) or a draw from
the target's sampling transform of head i's logits (sampled; the rows are reported, expanded to the
target vocabulary with zeros outside the draft vocabulary). The heads do not see the earlier draft
tokens, which is still lossless: each row is the distribution its token was drawn from.

Static trees (`tree_parents`, greedy batches only): node i at depth d is head d's r-th best token, r = its
rank among its siblings (Medusa's tree attention).
"""
from __future__ import annotations

import torch

from tandem.drafters.base import DrafterBase, draw_draft_tokens, register
from tandem.drafters.eagle import DAY0_DRAFT_VOCAB, sibling_ranks
from tandem.errors import InvalidParameterError
from tandem.models.eagle import draft_vocab_from_tokens, expand_to_target
from tandem.models.mtp import MtpConfig, MtpHeads, load_mtp, new_mtp_heads
from tandem.ops import tree as tree_ops
from tandem.ops.sampling import sampling_probs
from tandem.types import DraftTree


class MtpDrafter(DrafterBase):
    name = "mtp"

    def __init__(self, heads: MtpHeads, num_draft_tokens: int, tree_parents: tuple[int, ...] = ()):
        if num_draft_tokens < 1:
            raise InvalidParameterError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.heads = heads
        self.k = min(num_draft_tokens, heads.cfg.num_heads)
        self.parents = torch.tensor(tree_parents, dtype=torch.long)
        if tree_parents:
            tree_ops.validate_parents(self.parents)
            if int(tree_ops.depths(self.parents).max()) >= heads.cfg.num_heads:
                raise InvalidParameterError(f"the tree is deeper than the {heads.cfg.num_heads} heads")
        self.max_nodes = max(self.k, len(tree_parents))
        self.draft_to_target = heads.draft_to_target  # [Vd]
        self.last_hidden: dict[int, torch.Tensor] = {}  # row -> [d]

    def on_prefill(self, request, target_out) -> None:
        self.last_hidden[request.row] = target_out.final_hidden[0, -1]

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        for b, (request, result) in enumerate(zip(requests, results)):
            last = 1 + result.accepted_nodes[-1] if result.accepted_nodes else 0
            self.last_hidden[request.row] = target_out.final_hidden[b, last]

    def release(self, request) -> None:
        self.last_hidden.pop(request.row, None)

    def move_row(self, src_row: int, dst_row: int) -> None:
        self.last_hidden[dst_row] = self.last_hidden.pop(src_row)

    @torch.inference_mode()
    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        if max(budgets, default=0) == 0:
            return [DraftTree.empty() for _ in requests]
        logits = self.heads(torch.stack([self.last_hidden[r.row] for r in requests]))  # [B, K, Vd]
        greedy = all(r.params.greedy for r in requests)
        if greedy and len(self.parents):
            return self._static_tree(budgets, logits)
        tokens, probs = (logits[:, : self.k].argmax(-1), None) if greedy else self._sample(requests, logits[:, : self.k])
        out = []
        for b, budget in enumerate(budgets):
            k = min(self.k, budget)
            rows = None if probs is None else probs[b, :k]
            out.append(DraftTree.chain(self.draft_to_target[tokens[b, :k]].cpu(), rows) if k else DraftTree.empty())
        return out

    def _sample(self, requests, logits: torch.Tensor):  # [B, k, Vd] -> draft ids [B, k], probs [B, k, V]
        batch, k, _ = logits.shape
        per_row = lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(k)  # noqa: E731
        temperature = per_row([r.params.temperature for r in requests], torch.float32)
        top_k = per_row([r.params.top_k for r in requests], torch.long)
        top_p = per_row([r.params.top_p for r in requests], torch.float32)
        probs = sampling_probs(logits.reshape(batch * k, -1).float().cpu(), temperature, top_k, top_p)  # [B*k, Vd]
        vocab_ids = self.draft_to_target.cpu()
        by_step = probs.view(batch, k, -1)
        tokens = torch.stack([draw_draft_tokens(requests, by_step[:, j], j, vocab_ids) for j in range(k)], 1)
        expanded = expand_to_target(probs, vocab_ids, self.heads.cfg.target_vocab_size)
        return tokens.view(batch, k).to(logits.device), expanded.view(batch, k, -1)

    def _static_tree(self, budgets: list[int], logits: torch.Tensor) -> list[DraftTree]:
        depth = tree_ops.depths(self.parents)
        ranks = torch.tensor(sibling_ranks(tuple(self.parents.tolist())))
        best = logits.topk(int(ranks.max()) + 1, dim=-1).indices  # [B, K, r]
        draft_ids = best[:, depth, ranks]  # [B, N]
        tokens = self.draft_to_target[draft_ids].cpu()
        n = len(self.parents)
        return [DraftTree(tokens[b, : min(n, budget)], self.parents[: min(n, budget)]) for b, budget in enumerate(budgets)]


@register("mtp")
def _build(target, num_draft_tokens: int = 4, drafter_path: str | None = None, device: str = "cpu", tree_parents=None,
           draft_vocab_size: int = DAY0_DRAFT_VOCAB, **_) -> MtpDrafter:
    """From trained heads (drafter_path) or, without them, untrained heads sized for the target."""
    if drafter_path is not None:
        heads = load_mtp(drafter_path, target)
    else:
        cfg = MtpConfig.for_target(target.cfg, num_draft_tokens, draft_vocab_size)
        heads = new_mtp_heads(target, cfg, draft_vocab_from_tokens([], cfg.draft_vocab_size, target.cfg.vocab_size))
    heads = heads.to(device).eval().requires_grad_(False)
    heads.pack()
    return MtpDrafter(heads, num_draft_tokens, tuple(tree_parents or ()))
