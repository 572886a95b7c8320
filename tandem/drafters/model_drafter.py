"""Drafting with a small causal LM that keeps its own KV cache in step with the engine's rows.

Used by `draft_model` (another zoo model with the target's tokenizer) and `self_draft` (an int8 copy
of the target). Each proposal first catches the draft cache up on tokens it has not seen (normally the
pending token plus whatever the target accepted), then drafts a chain one token at a time for the whole
batch at once. After verification the cache is cut back to the tokens the target committed.
"""
from __future__ import annotations

import torch

from tandem.drafters.base import DrafterBase
from tandem.errors import InvalidParameterError
from tandem.models.kv_cache import KVCache
from tandem.models.transformer import Transformer
from tandem.ops.sampling import draw_uniform, sample_from_probs, sampling_probs
from tandem.types import DraftTree


class ModelDrafter(DrafterBase):
    def __init__(self, model: Transformer, target_vocab: int, num_draft_tokens: int, max_batch: int, max_len: int):
        if model.cfg.vocab_size != target_vocab:
            raise InvalidParameterError(f"the draft model's vocabulary ({model.cfg.vocab_size}) differs from the target's ({target_vocab})")
        if num_draft_tokens < 1:
            raise InvalidParameterError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.k = num_draft_tokens
        self.max_nodes = num_draft_tokens
        self.cache = KVCache(model.cfg, max_batch, max_len + num_draft_tokens + 2, model.embed.weight.dtype, model.embed.weight.device)

    def on_prefill(self, request, target_out) -> None:
        self.cache.reset(request.row)

    def reset_cache(self) -> None:
        for row in range(self.cache.max_batch):
            self.cache.reset(row)

    def move_row(self, src_row: int, dst_row: int) -> None:
        self.cache.move_row(src_row, dst_row)

    def on_verified(self, requests, drafts, results, starts, target_out) -> None:
        for request, result, start in zip(requests, results, starts):
            valid = min(int(self.cache.lengths[request.row]), start + 1 + result.num_accepted)
            self.cache.truncate(request.row, valid)

    @torch.inference_mode()
    def propose(self, requests, budgets: list[int]) -> list[DraftTree]:
        ks = [min(self.k, b) for b in budgets]
        if max(ks, default=0) == 0:
            return [DraftTree.empty() for _ in requests]
        logits = torch.stack([self._catch_up(r) for r in requests])  # [B, V]
        tokens, probs = [], []
        for step in range(max(ks)):
            if step:
                out = self.model(tokens[-1].unsqueeze(1).to(self.cache.k.device), cache=self.cache, rows=slice(0, len(requests)))
                logits = out.logits[:, -1]
            token, prob = self._pick(requests, logits)
            tokens.append(token)
            probs.append(prob)
        return [self._draft(b, k, tokens, probs) for b, k in enumerate(ks)]

    def _catch_up(self, request) -> torch.Tensor:  # -> [V] logits after the pending token
        seen = int(self.cache.lengths[request.row])
        ids = torch.tensor([request.all_ids[seen:]], device=self.cache.k.device)
        return self.model(ids, cache=self.cache, rows=slice(request.row, request.row + 1), last_only=True).logits[0, -1]

    def _pick(self, requests, logits: torch.Tensor):  # logits [B, V] -> tokens [B], probs [B, V] or None
        if all(r.params.greedy for r in requests):
            return logits.argmax(-1), None
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in requests])
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32)
        probs = sampling_probs(logits.float().cpu(), temperature, top_k, top_p)  # greedy rows come out one-hot
        tokens = sample_from_probs(probs, draw_uniform([r.generator for r in requests])[:, 0])
        return tokens, probs

    @staticmethod
    def _draft(b: int, k: int, tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> DraftTree:
        if k == 0:
            return DraftTree.empty()
        chain = torch.stack([t[b] for t in tokens[:k]]).cpu()
        rows = None if probs[0] is None else torch.stack([p[b] for p in probs[:k]])
        return DraftTree.chain(chain, rows)
