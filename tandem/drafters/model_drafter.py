"""Drafting with a small causal LM, batch-wide, one token at a time.

Used by `draft_model` (another zoo model with the target's tokenizer) and `self_draft` (an int8 copy
of the target). Two ways to hold the draft model's keys and values:
- its own KV cache (`draft_model`: another model's K/V), kept in step with the engine's rows: each proposal
  first catches the draft cache up on tokens it has not seen (a fresh request's whole prompt, then the
  pending token plus whatever the target accepted), and after verification the cache is cut back to the
  tokens the target committed;
- the target's own cache (`self_draft`, `shares_target_cache`): the copy approximates the target, so the
  target's K/V of the committed tokens stand in for the copy's, and nothing needs catching up (a fresh
  request's prompt was a second prefill through the copy, ~90 ms per 100 tokens here). Each draft step writes
  its token's K/V in the slots after the committed ones, which the verify forward rewrites before it reads
  them (it writes the pending token and the drafts there), and the cache's lengths are restored after drafting.
"""
from __future__ import annotations

import torch

from tandem.drafters.base import DrafterBase, draw_draft_tokens
from tandem.errors import InvalidParameterError
from tandem.models.kv_cache import KVCache
from tandem.models.transformer import Transformer
from tandem.ops.sampling import sampling_probs
from tandem.types import DraftTree


class ModelDrafter(DrafterBase):
    def __init__(self, model: Transformer, target_vocab: int, num_draft_tokens: int, max_batch: int, max_len: int,
                 shares_target_cache: bool = False):
        if model.cfg.vocab_size != target_vocab:
            raise InvalidParameterError(f"the draft model's vocabulary ({model.cfg.vocab_size}) differs from the target's ({target_vocab})")
        if num_draft_tokens < 1:
            raise InvalidParameterError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.k = num_draft_tokens
        self.max_nodes = num_draft_tokens
        self.shares_target_cache = shares_target_cache
        self.cache: KVCache | None = None  # shared: the proposing engine's, given by attach_target_cache
        if not shares_target_cache:
            self.cache = KVCache(model.cfg, max_batch, max_len + num_draft_tokens + 2, model.embed.weight.dtype, model.embed.weight.device)

    def attach_target_cache(self, cache: KVCache) -> None:
        if self.shares_target_cache:
            self.cache = cache

    def on_prefill(self, request, target_out) -> None:
        if not self.shares_target_cache:
            self.cache.reset(request.row)

    def move_row(self, src_row: int, dst_row: int) -> None:
        if not self.shares_target_cache:
            self.cache.move_row(src_row, dst_row)

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        if self.shares_target_cache:
            return
        for request, result, start in zip(requests, results, starts):
            valid = min(int(self.cache.lengths[request.row]), start + 1 + result.num_accepted)
            self.cache.truncate(request.row, valid)

    @torch.inference_mode()
    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        ks = [min(self.k, b) for b in budgets]
        if max(ks, default=0) == 0:
            return [DraftTree.empty() for _ in requests]
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__} drafts over the target's KV cache: the engine calls attach_target_cache() before propose()")
        saved = self.cache.lengths.clone() if self.shares_target_cache else None
        try:
            logits = self._pending_logits(requests) if self.shares_target_cache else torch.stack([self._catch_up(r) for r in requests])  # [B, V]
            tokens, probs = [], []
            for step in range(max(ks)):
                if step:
                    out = self.model(tokens[-1].unsqueeze(1).to(self.cache.k.device), cache=self.cache, rows=slice(0, len(requests)))
                    logits = out.logits[:, -1]
                token, prob = self._pick(requests, logits, step)
                tokens.append(token)
                probs.append(prob)
        finally:
            if saved is not None:
                self.cache.lengths.copy_(saved)  # the target's committed lengths: the drafts' slots are the verify's to write
        return [self._draft(b, k, tokens, probs) for b, k in enumerate(ks)]

    def _pending_logits(self, requests) -> torch.Tensor:  # -> [B, V]: every row's pending token over the target's cache
        for b, r in enumerate(requests):
            if r.row != b or int(self.cache.lengths[b]) != len(r.all_ids) - 1:
                raise RuntimeError(f"request {r.request_id}: row {r.row} holds {int(self.cache.lengths[r.row])} committed tokens, "
                                   f"expected row {b} with {len(r.all_ids) - 1} (all but the pending one)")
        ids = torch.tensor([[r.all_ids[-1]] for r in requests], device=self.cache.k.device)
        return self.model(ids, cache=self.cache, rows=slice(0, len(requests))).logits[:, -1]

    def _catch_up(self, request) -> torch.Tensor:  # -> [V] logits after the pending token
        seen = int(self.cache.lengths[request.row])
        ids = torch.tensor([request.all_ids[seen:]], device=self.cache.k.device)
        return self.model(ids, cache=self.cache, rows=slice(request.row, request.row + 1), last_only=True).logits[0, -1]

    def _pick(self, requests, logits: torch.Tensor, step: int):  # logits [B, V] -> tokens [B], probs [B, V] or None
        if all(r.params.greedy for r in requests):
            return logits.argmax(-1), None
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in requests])
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32)
        probs = sampling_probs(logits.float().cpu(), temperature, top_k, top_p)  # greedy rows come out one-hot
        tokens = draw_draft_tokens(requests, probs, step)
        return tokens, probs

    @staticmethod
    def _draft(b: int, k: int, tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> DraftTree:
        if k == 0:
            return DraftTree.empty()
        chain = torch.stack([t[b] for t in tokens[:k]]).cpu()
        rows = None if probs[0] is None else torch.stack([p[b] for p in probs[:k]])
        return DraftTree.chain(chain, rows)
