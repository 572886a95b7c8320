"""HF transformers as a peer in `tandem bench decode`: plain, prompt-lookup and assisted generation.

Same prompts (already chat-templated token ids), greedy, batch 1 (HF's assisted generation supports no
more), same threads, in the same run as tandem's drafters, so speedups are comparable ratios.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import InvalidParameterError


def load_hf_causal_lm(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_modes(base, config) -> dict[str, dict]:
    """Generation kwargs per HF mode; assisted only when a draft model was named."""
    modes = {"hf": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": config.num_draft_tokens}}
    if config.drafter_model:
        from tandem.models.zoo import resolve_model

        modes["hf_assisted"] = {"assistant_model": load_hf_causal_lm(resolve_model(config.drafter_model))}
    return modes


@dataclass
class PeerOutput:
    token_ids: list[int]
    metrics: dict | None = None  # HF reports no speculation metrics


def hf_runners(base, config) -> dict:
    """One runner per HF mode, batch 1 (HF's assisted and prompt-lookup generation support no more)."""
    if config.batch_size != 1:
        raise InvalidParameterError("--peers hf needs --batch-size 1 (HF's speculative generation is batch-1 only)")
    hf = load_hf_causal_lm(base.model_dir)
    eos = list(base.target.cfg.eos_token_ids) or None
    return {name: _hf_runner(hf, config.max_tokens, eos, kwargs) for name, kwargs in hf_modes(base, config).items()}


def _hf_runner(hf, max_tokens: int, eos, kwargs):
    return lambda batch: [PeerOutput(_generate(hf, ids, max_tokens, eos, kwargs)) for ids in batch]


def _generate(hf, ids: list[int], max_tokens: int, eos, kwargs) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **kwargs)
    return out[0, len(ids) :].tolist()
