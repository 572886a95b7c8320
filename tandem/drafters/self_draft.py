"""`self_draft`: an int8 copy of the target drafts for it (EfficientRollout-style self-speculation).

The copy is built at load and re-quantized in place whenever the target's weights change
(`resync()`), so it never drifts from the policy during RL. It drafts over the target's own KV cache
(ModelDrafter's `shares_target_cache`): no draft cache, no second prefill of every prompt.
"""
from __future__ import annotations

from tandem.drafters.base import register
from tandem.drafters.model_drafter import ModelDrafter
from tandem.models.quantize import quantized_copy, resync_


class SelfDrafter(ModelDrafter):
    name = "self_draft"

    def __init__(self, target, num_draft_tokens: int, max_batch: int, max_len: int):
        super().__init__(quantized_copy(target), target.cfg.vocab_size, num_draft_tokens, max_batch, max_len, shares_target_cache=True)
        self.target = target

    def resync(self) -> None:
        """The target's weights changed: re-share embedding/norms, re-quantize in place and bump the version.
        Call between rollouts (the engine's cache, which it drafts over, is the engine's to rebuild)."""
        resync_(self.model, self.target)
        self.version += 1


@register("self_draft")
def _build(target, num_draft_tokens: int = 4, max_batch: int = 8, max_len: int | None = None, **_) -> SelfDrafter:
    return SelfDrafter(target, num_draft_tokens, max_batch, max_len or target.cfg.max_position)
