"""`tandem bench forward`: AR decode speed vs HF transformers, k-token forward cost, and the roofline.

Everything is measured in one run on the same prompts and thread count, so ratios are comparable.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from tandem.bench.machine import (BandwidthProbe, bracketed, describe_unsteady, machine_info, probe_bandwidth_gbps, require_steady,
                                  resident_mb)
from tandem.models import cpu_gemm
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
    """Bytes a decode step must stream: every matmul weight as it is served (fp32 / bf16 / int8 / int4 with their scales);
    the embedding reads one row per token."""
    embed = model.embed.weight
    total = sum(served_bytes(lin, embed.element_size()) for lin in model.linears())
    return total + embed.shape[1] * embed.element_size()


def served_bytes(lin, element_size: int) -> int:
    """The bytes of one Linear's weight that its kernel reads: the packed int4 / bf16 / int8 copy and its scales, else the dense weight."""
    if lin.compact is not None:
        return sum(t.numel() * t.element_size() for t in (lin.compact.packed, lin.compact.scale))
    if lin.int8 is not None:
        return lin.int8[0].numel() + lin.int8[1].numel() * 4
    return lin.in_features * lin.out_features * element_size


def weight_bytes_total(model: Transformer) -> int:
    """Bytes of one copy of every weight (dense or packed-only; a tied head counted once)."""
    elements = sum(p.numel() for p in model.parameters()) + sum(lin.in_features * lin.out_features for lin in model.linears() if lin.dense_dropped)
    return elements * model.embed.weight.element_size()


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


def forward_cost_pair_ms(model: Transformer, ks=COST_KS, context: int = 64, reps: int = 15, batch: int = 1) -> dict[str, dict[int, float]]:
    """Median ms of one cached forward over k new tokens per row (`batch` rows), eager and compiled
    interleaved rep by rep, on the model's device (CUDA: synchronised, compiled = CUDA graphs)."""
    from tandem.models.compiled import CompiledForward

    device = model.embed.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    caches = {name: KVCache(model.cfg, batch, context + max(ks) + 1, model.embed.weight.dtype, device) for name in ("eager", "compiled")}
    compiled = CompiledForward(model, caches["compiled"], progress=lambda m: print(f"[bench forward] {m}", flush=True))
    run = {"eager": lambda ids, pos: model(ids, positions=pos, cache=caches["eager"], rows=slice(0, batch)), "compiled": lambda ids, pos: compiled(ids, pos)}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[int, float]] = {"eager": {}, "compiled": {}}
    with torch.inference_mode():
        prompt = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=gen).to(device)
        for cache in caches.values():
            model(prompt, cache=cache, rows=slice(0, batch))
        for k in ks:
            ids = torch.randint(0, model.cfg.vocab_size, (batch, k), generator=gen).to(device)
            pos = (context + torch.arange(k)).expand(batch, k).to(device)
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(reps + 2):
                for name in times:
                    sync()
                    t = time.perf_counter()
                    run[name](ids, pos)
                    sync()
                    times[name].append(time.perf_counter() - t)
                    for row in range(batch):
                        caches[name].truncate(row, context)
            for name in times:
                out[name][k] = statistics.median(times[name][2:]) * 1000
    return out


def timed_engine(engine, tokenizer, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    from tandem.config import SamplingParams

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    t = time.perf_counter()
    request = engine.run([ids], [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)])[0]
    return time.perf_counter() - t, request.output_ids


def compiled_ar_comparison(llm, prompts: list[str], max_tokens: int, rounds: int = 2) -> dict:
    """Batch-1 greedy tokens/s, eager vs compiled engines over the same target, interleaved prompt by prompt."""
    from dataclasses import replace

    from tandem.engine.engine import Engine

    engines = {"eager": Engine(llm.target, replace(llm.config, compile=False)), "compiled": Engine(llm.target, replace(llm.config, compile=True))}
    for engine in engines.values():
        timed_engine(engine, llm.tokenizer, prompts[0], max_tokens)  # compiles the shapes this run reaches
    totals = {name: [0.0, 0] for name in engines}
    outputs: dict[str, list] = {name: [] for name in engines}
    for _ in range(rounds):
        for prompt in prompts:
            for name, engine in engines.items():
                seconds, ids = timed_engine(engine, llm.tokenizer, prompt, max_tokens)
                totals[name][0] += seconds
                totals[name][1] += len(ids)
                outputs[name].append(ids)
    rates = {name: n / s for name, (s, n) in totals.items()}
    return {"eager_tokens_per_s": round(rates["eager"], 2), "compiled_tokens_per_s": round(rates["compiled"], 2),
            "speedup": round(rates["compiled"] / rates["eager"], 3), "greedy_identical": outputs["eager"] == outputs["compiled"]}


def timed_ours(llm, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    from tandem.config import SamplingParams

    t = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return time.perf_counter() - t, out.token_ids


def timed_hf(hf, tokenizer, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t
    return seconds, out[0, ids.shape[1] :].tolist()


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: always generate max_tokens, logits untouched
    return hf


def ar_comparison(llm, hf, prompts: list[str], max_tokens: int, rounds: int = 2) -> dict:
    """Batch-1 greedy tokens/s of ours and HF's, interleaved prompt by prompt so machine noise hits both."""
    timed_ours(llm, prompts[0], 4)
    if hf is not None:
        timed_hf(hf, llm.tokenizer, prompts[0], 4)
    totals = {"ours": [0.0, 0], "hf": [0.0, 0]}
    matches = True
    for _ in range(rounds):
        for prompt in prompts:
            seconds, ours = timed_ours(llm, prompt, max_tokens)
            totals["ours"][0] += seconds
            totals["ours"][1] += len(ours)
            if hf is not None:
                seconds, theirs = timed_hf(hf, llm.tokenizer, prompt, max_tokens)
                totals["hf"][0] += seconds
                totals["hf"][1] += len(theirs)
                matches &= ours == theirs
    rates = {k: n / s for k, (s, n) in totals.items() if n}
    return rates | {"greedy_matches_hf": matches if hf is not None else None}


def interleaved_ar(runners: dict, prompts: list[str], max_tokens: int, rounds: int = 2) -> tuple[dict[str, float], bool]:
    """Batch-1 greedy tokens/s of each runner (name -> (llm, set-up called before each of its prompts)),
    interleaved prompt by prompt so machine noise hits all; and whether their outputs are identical."""
    for llm, setup in runners.values():
        setup()
        timed_ours(llm, prompts[0], 4)
    totals = {name: [0.0, 0] for name in runners}
    outputs: dict[str, list] = {name: [] for name in runners}
    for _ in range(rounds):
        for prompt in prompts:
            for name, (llm, setup) in runners.items():
                setup()
                seconds, ids = timed_ours(llm, prompt, max_tokens)
                totals[name][0] += seconds
                totals[name][1] += len(ids)
                outputs[name].append(ids)
    first = next(iter(outputs.values()))
    return {name: n / s for name, (s, n) in totals.items()}, all(o == first for o in outputs.values())


def _ab_report(rates: dict[str, float], costs: dict[str, dict[int, float]], identical: bool, new: str, old: str) -> dict:
    return {
        "ar_tokens_per_s": {name: round(r, 2) for name, r in rates.items()}, "speedup": round(rates[new] / rates[old], 3),
        "cost_ms": {name: {k: round(v, 2) for k, v in c.items()} for name, c in costs.items()},
        "greedy_identical": identical,
    }


def gemm_comparison(llm, prompts: list[str], max_tokens: int, rounds: int = 2) -> dict:
    """The small-M kernel (llm's target) against oneDNN's prepacked GEMMs on a second copy of the target:
    batch-1 greedy tokens/s interleaved prompt by prompt, and the k-token forward cost of each."""
    from tandem.llm import LLM

    onednn = LLM(model=str(llm.model_dir), pack_weights=False)
    onednn.target.pack(gemm="onednn")
    rates, identical = interleaved_ar({"kernel": (llm, lambda: None), "onednn": (onednn, lambda: None)}, prompts, max_tokens, rounds)
    costs = {name: forward_cost_ms(runner.target, ks=(1, 5, 9)) for name, runner in (("kernel", llm), ("onednn", onednn))}
    return _ab_report(rates, costs, identical, "kernel", "onednn")


GLUES = {"fused_stack": (True, True), "fused": (True, False), "torch_ops": (False, False)}  # (fused_glue, fused_stack)


def glue_comparison(llm, prompts: list[str], max_tokens: int, rounds: int = 2) -> dict:
    """The layers in one fused call, the fused glue layer by layer (tandem.models.decode_glue) and the torch-op
    glue, on the same target (`Transformer.fused_glue` / `fused_stack` switched per prompt): greedy tokens/s
    interleaved, and the k-token forward cost of each."""
    target = llm.target

    def use(glue: str):
        return lambda: _set_glue(target, glue)

    rates, identical = interleaved_ar({name: (llm, use(name)) for name in GLUES}, prompts, max_tokens, rounds)
    costs = {}
    for name in GLUES:
        _set_glue(target, name)
        costs[name] = forward_cost_ms(target, ks=(1, 5, 9))
    _set_glue(target, "fused_stack")
    report = _ab_report(rates, costs, identical, "fused_stack", "torch_ops")
    return report | {"stack_over_per_layer": round(rates["fused_stack"] / rates["fused"], 3)}


def _set_glue(target: Transformer, glue: str) -> None:
    target.fused_glue, target.fused_stack = GLUES[glue]


def op_profile(model: Transformer, context: int = 200, steps: int = 10, top: int = 12) -> dict[str, list[dict]]:
    """Per-op self time of one cached 1-token forward after `context` tokens (torch.profiler, ms per step),
    with the torch-op glue, the fused glue layer by layer, and the fused layers in one call (what decoding
    runs; the profiler sees only the one op there), on the same model: where a decode step's time goes."""
    cache = KVCache(model.cfg, 1, context + 2)
    ids = torch.tensor([[5]])
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)), cache=cache)
        for name in reversed(GLUES):
            _set_glue(model, name)
            for _ in range(3):
                model(ids, cache=cache)
                cache.truncate(0, context)
            with torch.profiler.profile() as prof:
                for _ in range(steps):
                    model(ids, cache=cache)
                    cache.truncate(0, context)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events) / steps / 1000
            out[name] = [{"op": "(all)", "ms_per_step": round(total, 2), "calls_per_step": sum(e.count for e in events) // steps}] + [
                {"op": e.key, "ms_per_step": round(e.self_cpu_time_total / steps / 1000, 3), "calls_per_step": e.count // steps} for e in events[:top]]
    _set_glue(model, "fused_stack")
    return out


def model_resident_mb(model_dir, pack: bool, weights: str = "fp32") -> float:
    """Resident memory of one more copy of the target (+ its packed weights, at `weights`), loaded in this process
    after everything else: the RSS it adds, without the engine's KV cache, the tokenizer or libraries."""
    from tandem.config import WEIGHTS
    from tandem.models.loader import load_transformer

    before = resident_mb()
    target = load_transformer(model_dir)
    if pack:
        target.pack(gemm=WEIGHTS[weights])
    added = resident_mb() - before
    del target
    return added


ROWS = {"ar": "plain decoding vs the roofline", "forward": "1-token forward vs the roofline",
        "compiled": "compiled 1-token forward vs the roofline"}  # the rows whose fraction of the roofline divides by bandwidth


def run_forward_bench(model: str, max_tokens: int = 64, with_hf: bool = True, pack: bool = True, compile: bool = False, gemm_ab: bool = False,
                      glue_ab: bool = False, profile: bool = False, weights: str = "fp32", strict_probe: bool = False,
                      probe: Callable[[], float] | None = None) -> dict:
    """Each row that divides by memory bandwidth runs between two probes (`probe`, default probe_bandwidth_gbps) and
    divides by their mean; `bandwidth_probes` records both per row. A row whose probes differ by more than 15 % is
    flagged (`steady` false), or with `strict_probe` refused (UnsteadyMachineError naming the row)."""
    from tandem.llm import LLM

    llm = LLM(model=model, pack_weights=pack, weights=weights)
    rss_model = model_resident_mb(llm.model_dir, pack, weights)  # at the served weights (an int4 run measured fp32's before)
    hf = load_hf(llm.model_dir) if with_hf else None
    prompts = list(BENCH_PROMPTS)
    probes: dict[str, BandwidthProbe] = {}

    def timed(row: str, section):
        result, probes[row] = bracketed(section, probe or probe_bandwidth_gbps)
        require_steady(ROWS[row], probes[row], strict_probe)
        return result

    weight_bytes = weight_bytes_per_token(llm.target)
    rates = timed("ar", lambda: ar_comparison(llm, hf, prompts, max_tokens))
    cost = timed("forward", lambda: forward_cost_ms(llm.target))
    bandwidth = probes["ar"].mean_gbps
    roofline = bandwidth * 1e9 / weight_bytes
    ours = rates["ours"]
    result = {
        "model": model, "weights": weights, "max_tokens": max_tokens, "packed_weights": pack, "machine": machine_info(), "gemm_kernel": cpu_gemm.describe(),
        "ar_tokens_per_s": round(ours, 2), "roofline_tokens_per_s": round(roofline, 2),
        "fraction_of_roofline": round(ours / roofline, 3), "memory_bandwidth_gbps": round(bandwidth, 2),
        "weight_bytes_per_token": weight_bytes, "resident_model_mb": round(rss_model),
        "resident_over_weights": round(rss_model * 2**20 / weight_bytes_total(llm.target), 2), "forward_ms_per_token": round(cost[1], 2),
        "forward_fraction_of_roofline": _forward_fraction(weight_bytes, probes["forward"], cost[1]),
        "cost_ms": {k: round(v, 3) for k, v in cost.items()},
        "cost_ratio": {k: round(v / cost[1], 3) for k, v in cost.items()},
    }
    if compile:
        pair = timed("compiled", lambda: forward_cost_pair_ms(llm.target, ks=(1, 2, 4, 5)))
        result["compiled"] = {
            "ar": compiled_ar_comparison(llm, prompts, max_tokens),
            "cost_ms": {name: {k: round(v, 3) for k, v in c.items()} for name, c in pair.items()},
            "cost_ratio": {name: {k: round(v / c[1], 3) for k, v in c.items()} for name, c in pair.items()},
            "forward_fraction_of_roofline": {name: _forward_fraction(weight_bytes, probes["compiled"], c[1]) for name, c in pair.items()},
        }
    result["bandwidth_probes"] = {row: p.as_dict() for row, p in probes.items()}
    if gemm_ab:
        result["gemm"] = gemm_comparison(llm, prompts, max_tokens)
    if glue_ab:
        result["glue"] = glue_comparison(llm, prompts, max_tokens)
    if profile:
        result["op_profile"] = op_profile(llm.target)
    if hf is not None:
        result |= {"hf_ar_tokens_per_s": round(rates["hf"], 2), "speedup_vs_hf": round(ours / rates["hf"], 3),
                   "greedy_matches_hf": rates["greedy_matches_hf"]}
    return result


def _forward_fraction(weight_bytes: int, probe: BandwidthProbe, ms: float) -> float:
    """The roofline's time for one forward (the weights at the probes' mean bandwidth) over the measured `ms`."""
    return round(weight_bytes / probe.mean_gbps / 1e9 * 1000 / ms, 3)


def unsteady_rows(result: dict) -> list[str]:
    """The rows of a forward result whose bandwidth probes were not steady, as `describe_unsteady` lines."""
    probes = result.get("bandwidth_probes", {})
    return [describe_unsteady(ROWS[row], p["before_gbps"], p["after_gbps"]) for row, p in probes.items() if not p["steady"]]
