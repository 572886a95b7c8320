"""`draft_model`: a smaller zoo model with the same tokenizer drafts for the target.

`draft_weights` (drafter option; `draft_model_int8` / `draft_model_int4` as drafter names) serves the drafting model
at int8 / int4 (tandem.config.WEIGHTS): a 0.5B drafting for an int4 1.5B in fp32 would cost more per token than the
target it drafts for."""
from __future__ import annotations

from tandem.config import WEIGHTS
from tandem.drafters.base import register
from tandem.drafters.model_drafter import ModelDrafter
from tandem.errors import InvalidParameterError


def _load(target, num_draft_tokens: int, drafter_model: str | None, max_batch: int, max_len: int | None, device: str, draft_weights: str) -> ModelDrafter:
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    if drafter_model is None:
        raise InvalidParameterError("drafter='draft_model' needs drafter_model= (a zoo name or model directory)")
    if draft_weights not in WEIGHTS:
        raise InvalidParameterError(f"draft_model: draft_weights must be one of {sorted(WEIGHTS)}, got {draft_weights!r}")
    model = load_transformer(resolve_model(drafter_model), device=device)
    model.pack(gemm=WEIGHTS[draft_weights])
    return ModelDrafter(model, target.cfg.vocab_size, num_draft_tokens, max_batch, max_len or target.cfg.max_position)  # named by build_drafter


@register("draft_model")
def _build(target, num_draft_tokens: int = 4, drafter_model: str | None = None, max_batch: int = 8, max_len: int | None = None, device: str = "cpu",
           draft_weights: str = "fp32", **_) -> ModelDrafter:
    return _load(target, num_draft_tokens, drafter_model, max_batch, max_len, device, draft_weights)


@register("draft_model_int8")
def _build_int8(target, num_draft_tokens: int = 4, drafter_model: str | None = None, max_batch: int = 8, max_len: int | None = None, device: str = "cpu", **_) -> ModelDrafter:
    return _load(target, num_draft_tokens, drafter_model, max_batch, max_len, device, "int8")


@register("draft_model_int4")
def _build_int4(target, num_draft_tokens: int = 4, drafter_model: str | None = None, max_batch: int = 8, max_len: int | None = None, device: str = "cpu", **_) -> ModelDrafter:
    return _load(target, num_draft_tokens, drafter_model, max_batch, max_len, device, "int4")
