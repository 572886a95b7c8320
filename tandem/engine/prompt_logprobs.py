"""Log-probs of a prompt's own tokens under the target (OpenAI completions `echo` with `logprobs`, vLLM's prompt_logprobs)."""
from __future__ import annotations

import torch


@torch.inference_mode()
def prompt_logprobs(model, prompt_ids: list[int], k: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """Per prompt token: (token, its log-prob given the tokens before it, the k most likely (token, log-prob) there), all
    under the untempered target (log_softmax of its logits); the first token has neither (nothing precedes it). One
    forward over the prompt without a KV cache: it reads the weights only, so it may run between engine steps."""
    device = model.embed.weight.device
    logits = model(torch.tensor([prompt_ids], device=device)).logits[0, :-1].float().cpu()  # [L - 1, V]: position i predicts i + 1
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, torch.tensor(prompt_ids[1:]).view(-1, 1)).squeeze(-1).tolist()
    tops: list[list[tuple[int, float]] | None] = [None] * len(chosen)
    if k > 0:
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [(prompt_ids[0], None, None)] + [(t, lp, top) for t, lp, top in zip(prompt_ids[1:], chosen, tops)]
