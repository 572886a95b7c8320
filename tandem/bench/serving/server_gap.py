"""`python -m tandem.bench.serving.server_gap`: what serving over HTTP costs against the engine alone (issue 40's gap).

The same prompts, greedy, EOS stops, the same max tokens and threads, alternated `--rounds` times in one run so a
changing load hits both sides alike: the engine alone (`tandem bench throughput`'s loop: every prompt queued,
packed prefill, stepped to the end, in this process) and `tandem serve` with its default flags in a child process,
driven by as many concurrent streaming chat clients as there are prompts (`tandem bench serve`'s load generator).
Reported: output tokens/s of each, their ratio per round and over all rounds, the server's p50/p99 time to first
token.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from tandem.bench.children import ChildServer, free_port, tandem_env, tandem_serve_command
from tandem.bench.serving.load import _level, _percentile
from tandem.bench.serving.throughput import serve_all
from tandem.config import SamplingParams
from tandem.data.prompts import load_prompts


def engine_alone(llm, prompt_ids: list[list[int]], params: SamplingParams) -> dict:
    from tandem.engine.engine import Engine

    engine = Engine(llm.target, replace(llm.config, max_batch_size=len(prompt_ids)))
    stats, _ = serve_all(engine, prompt_ids, params)
    del engine
    gc.collect()
    return {"tokens_per_s": stats["output_tokens_per_s"], "output_tokens": stats["output_tokens"]}


def served(model: str, prompts: list[str], max_tokens: int, max_model_len: int, threads: int, log_dir: Path) -> dict:
    port = free_port()
    cmd = tandem_serve_command(model, port, threads, ["--served-model-name", "bench", "--max-model-len", str(max_model_len)])
    server = ChildServer("tandem", cmd, port, log_dir / "tandem_serve.log", env=tandem_env(threads), ready_path="/ready")
    try:
        results, wall = asyncio.run(_level(server.url, "bench", prompts, len(prompts), max_tokens))
    finally:
        server.close()
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {"tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 2), "output_tokens": sum(r.output_tokens for r in ok), "failed": len(results) - len(ok),
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99)}


def run(model: str, num_prompts: int, max_tokens: int, max_model_len: int, threads: int, rounds: int) -> dict:
    from tandem.llm import LLM

    prompts = [p.prompt for p in load_prompts("builtin", per_domain=12, split="test")][:num_prompts]
    llm = LLM(model, max_batch_size=1, max_model_len=max_model_len, num_threads=threads)
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine_alone(llm, ids, params)  # warm-up: weights' and cache pages' first touch, the kernels loaded
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for r in range(rounds):
            engine = engine_alone(llm, ids, params)
            server = served(model, prompts, max_tokens, max_model_len, threads, Path(logs))
            rows.append({"round": r, "engine": engine, "server": server, "ratio": round(server["tokens_per_s"] / engine["tokens_per_s"], 3),
                         "load_average": round(os.getloadavg()[0], 2)})
            print(json.dumps(rows[-1]), flush=True)
    engine_mean = sum(r["engine"]["tokens_per_s"] for r in rows) / rounds
    server_mean = sum(r["server"]["tokens_per_s"] for r in rows) / rounds
    return {"model": model, "prompts": num_prompts, "max_tokens": max_tokens, "threads": threads, "rounds": rows,
            "engine_tokens_per_s": round(engine_mean, 2), "server_tokens_per_s": round(server_mean, 2), "ratio": round(server_mean / engine_mean, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    result = run(args.model, args.num_prompts, args.max_tokens, args.max_model_len, args.threads, args.rounds)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"server {result['server_tokens_per_s']} tok/s, engine {result['engine_tokens_per_s']} tok/s: ratio {result['ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
