"""`make demo`: the main job on the embedded default model.

Until the flywheel lands this serves a few chat prompts with plain decoding and with speculative
decoding, and prints the text, tokens/s and acceptance length of each.
"""
from __future__ import annotations

import time

DEMO_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Explain in two sentences why the sky is blue.",
)


def run_demo(model: str, max_tokens: int) -> None:
    from tandem import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for drafter in (None, "ngram"):
        t = time.perf_counter()
        llm = LLM(model=model, drafter=drafter, num_draft_tokens=4)
        print(f"\n=== {model}, drafter={drafter or 'none (plain decoding)'} (loaded in {time.perf_counter() - t:.1f}s) ===")
        outputs = llm.chat([[{"role": "user", "content": p}] for p in DEMO_PROMPTS], params)
        tokens = sum(len(o.token_ids) for o in outputs)
        seconds = outputs[0].metrics["wall_time_s"]
        for prompt, out in zip(DEMO_PROMPTS, outputs):
            print(f"\n> {prompt}\n{out.text.strip()}")
        print(f"\n[{tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tokens/s, batch of {len(outputs)}; "
              f"acceptance length {_mean(o.metrics['acceptance_length'] for o in outputs):.2f}]")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
