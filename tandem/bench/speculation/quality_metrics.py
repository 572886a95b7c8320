"""The quality bench's per-sample arithmetic, shared by tandem's precisions (tandem.bench.speculation.quality) and the llama.cpp
columns (tandem.bench.peers.quality_llama)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Sample:
    domain: str
    prompt: list[int]  # chat-rendered prompt ids
    continuation: list[int]  # fp32 greedy continuation ids


def forced_metrics(token_logprobs, argmax, sample: Sample) -> dict[str, float]:
    """Mean log-probs and top-1 agreement with the fp32 continuation, from position t's log-prob of token t + 1 and its
    argmax (t < len(prompt + continuation) - 1): the same arithmetic for tandem's precisions and for peers."""
    ids = sample.prompt + sample.continuation
    p, n = len(sample.prompt), len(sample.continuation)
    cont = range(p - 1, p - 1 + n)
    return {"prompt_logprob": statistics.fmean(token_logprobs[: p - 1]),
            "continuation_logprob": statistics.fmean(token_logprobs[t] for t in cont),
            "top1_agreement": statistics.fmean(float(argmax[t] == ids[t + 1]) for t in cont)}


def prefix_agreement(ours: list[int], reference: list[int]) -> float:
    """Tokens before the first difference, over the reference's length (1.0: identical)."""
    same = 0
    for a, b in zip(ours, reference):
        if a != b:
            break
        same += 1
    return same / max(len(reference), 1)
