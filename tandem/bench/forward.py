"""`tandem bench forward`: AR decode speed vs HF transformers, k-token forward cost, and the roofline.

Everything is measured in one run on the same prompts and thread count, so ratios are comparable.
"""
from __future__ import annotations

import statistics
import time

import torch

from tandem.bench.machine import machine_info, memory_bandwidth_gbps
from tandem.models.kv_cache import KVCache
from tandem.models.transformer import Transformer

BENCH_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "SELECT name, COUNT(*) FROM employees",
    "The three most important causes of the French Revolution were",
    "Translate to French: The weather is nice today and we are going to the beach.",
)
COST_KS = (1, 2, 3, 4, 5, 8, 16)


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes a decode step must stream: every matmul weight; the embedding reads one row per token."""
    total = sum(lin.weight.numel() * lin.weight.element_size() for lin in model.linears())
    embed = model.embed.weight
    return total + embed.shape[1] * embed.element_size()


def forward_cost_ms(model: Transformer, ks=COST_KS, context: int = 64, reps: int = 15) -> dict[int, float]:
    """Median ms of one cached forward over k new tokens after `context` tokens, per k."""
    cache = KVCache(model.cfg, 1, context + max(ks) + 1)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen), cache=cache)
        out = {}
        for k in ks:
            ids = torch.randint(0, model.cfg.vocab_size, (1, k), generator=gen)
            times = []
            for _ in range(reps + 2):
                t = time.perf_counter()
                model(ids, cache=cache)
                times.append(time.perf_counter() - t)
                cache.truncate(0, context)
            out[k] = statistics.median(times[2:]) * 1000
    return out


def ours_ar_tokens_per_s(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    from tandem.config import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    tokens, seconds, outputs = 0, 0.0, []
    for prompt in prompts:  # batch 1, one prompt at a time, like HF generate
        t = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        seconds += time.perf_counter() - t
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    return tokens / seconds, outputs


def hf_ar_tokens_per_s(model_dir, tokenizer, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: always generate max_tokens, logits untouched
    tokens, seconds, outputs = 0, 0.0, []
    with torch.inference_mode():
        warm = torch.tensor([tokenizer.encode(prompts[0], add_special_tokens=False)])
        hf.generate(warm, max_new_tokens=4, do_sample=False)
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            seconds += time.perf_counter() - t
            tokens += out.shape[1] - ids.shape[1]
            outputs.append(out[0, ids.shape[1] :].tolist())
    return tokens / seconds, outputs


def run_forward_bench(model: str, max_tokens: int = 64, with_hf: bool = True, pack: bool = True) -> dict:
    from tandem.llm import LLM

    llm = LLM(model=model, pack_weights=pack)
    prompts = list(BENCH_PROMPTS)
    bandwidth = memory_bandwidth_gbps()
    weight_bytes = weight_bytes_per_token(llm.target)
    roofline = bandwidth * 1e9 / weight_bytes
    ours, our_outputs = ours_ar_tokens_per_s(llm, prompts, max_tokens)
    cost = forward_cost_ms(llm.target)
    result = {
        "model": model, "max_tokens": max_tokens, "packed_weights": pack, "machine": machine_info(),
        "ar_tokens_per_s": round(ours, 2), "roofline_tokens_per_s": round(roofline, 2),
        "fraction_of_roofline": round(ours / roofline, 3), "memory_bandwidth_gbps": round(bandwidth, 2),
        "weight_bytes_per_token": weight_bytes, "cost_ms": {k: round(v, 3) for k, v in cost.items()},
        "cost_ratio": {k: round(v / cost[1], 3) for k, v in cost.items()},
    }
    if with_hf:
        hf, hf_outputs = hf_ar_tokens_per_s(llm.model_dir, llm.tokenizer, prompts, max_tokens)
        result |= {"hf_ar_tokens_per_s": round(hf, 2), "speedup_vs_hf": round(ours / hf, 3),
                   "greedy_matches_hf": our_outputs == hf_outputs}
    return result
