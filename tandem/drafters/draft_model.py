"""`draft_model`: a smaller zoo model with the same tokenizer drafts for the target."""
from __future__ import annotations

from tandem.drafters.base import register
from tandem.drafters.model_drafter import ModelDrafter
from tandem.errors import InvalidParameterError


@register("draft_model")
def _build(target, num_draft_tokens: int = 4, drafter_model: str | None = None, max_batch: int = 8, max_len: int | None = None, device: str = "cpu", **_) -> ModelDrafter:
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    if drafter_model is None:
        raise InvalidParameterError("drafter='draft_model' needs drafter_model= (a zoo name or model directory)")
    model = load_transformer(resolve_model(drafter_model), device=device)
    model.pack()
    drafter = ModelDrafter(model, target.cfg.vocab_size, num_draft_tokens, max_batch, max_len or target.cfg.max_position)
    drafter.name = "draft_model"
    return drafter
