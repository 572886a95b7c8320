"""`self_draft`: an int8 copy of the target drafts for it (EfficientRollout-style self-speculation).

`draft_weights="int4"` (drafter option; `self_draft_int4` as a drafter name) drafts with a group-wise int4 copy
instead: half the int8 copy's bytes per drafted token, for an int8 or fp32 target (acceptance is lower: measure it).

The copy is built at load and re-quantized in place whenever the target's weights change
(`resync()`), so it never drifts from the policy during RL. It drafts over the target's own KV cache
(ModelDrafter's `shares_target_cache`): no draft cache, no second prefill of every prompt.
"""
from __future__ import annotations

from tandem.drafters.base import register
from tandem.errors import InvalidParameterError
from tandem.drafters.model_drafter import ModelDrafter
from tandem.models.quantize import quantized_copy, resync_


class SelfDrafter(ModelDrafter):
    name = "self_draft"

    def __init__(self, target, num_draft_tokens: int, max_batch: int, max_len: int, draft_weights: str = "int8"):
        if draft_weights not in DRAFT_WEIGHTS:
            raise InvalidParameterError(f"self_draft: draft_weights must be one of {sorted(DRAFT_WEIGHTS)}, got {draft_weights!r}")
        copy = quantized_copy(target, bits=DRAFT_WEIGHTS[draft_weights])
        super().__init__(copy, target.cfg.vocab_size, num_draft_tokens, max_batch, max_len, shares_target_cache=True)
        self.target = target

    def resync(self) -> None:
        """The target's weights changed: re-share embedding/norms, re-quantize in place and bump the version.
        Call between rollouts (the engine's cache, which it drafts over, is the engine's to rebuild)."""
        resync_(self.model, self.target)
        self.version += 1


DRAFT_WEIGHTS = {"int8": 8, "int4": 4}  # the copy's weights -> quantized_copy's bits


@register("self_draft")
def _build(target, num_draft_tokens: int = 4, max_batch: int = 8, max_len: int | None = None, draft_weights: str = "int8", **_) -> SelfDrafter:
    return SelfDrafter(target, num_draft_tokens, max_batch, max_len or target.cfg.max_position, draft_weights)


@register("self_draft_int4")
def _build_int4(target, num_draft_tokens: int = 4, max_batch: int = 8, max_len: int | None = None, **_) -> SelfDrafter:
    return SelfDrafter(target, num_draft_tokens, max_batch, max_len or target.cfg.max_position, "int4")
