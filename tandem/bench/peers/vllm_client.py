"""`tandem bench serve --vllm-client`: vLLM's own benchmark client against `tandem serve`, checked against /metrics.

A real client that nobody here wrote (`vllm.benchmarks.serve` from the peer harness's vLLM venv, through
vllm_client_worker.py): random prompts of `input_len` tokens, `max_tokens` out with ignore_eos, streaming chat
completions (`--backend openai-chat`) or completions (`openai`), at `concurrency`. Around its run this reads
tandem's `/metrics` (Prometheus text) and compares the client's mean TTFT, ITL, TPOT, end-to-end latency and
output throughput with the deltas of the server's histograms (`_sum` / `_count`) and counters. The client has
no ready check or warm-up requests by default, so the deltas cover exactly its requests (the server is warmed up
by tandem's own load generator before the first read).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench.children import ChildServer, free_port, log_tail, sigterm_as_interrupt, tandem_env, tandem_serve_command
from tandem.bench.machine import machine_info
from tandem.bench.peers.serve_peer import SERVED, vllm_python, warm_up
from tandem.data.prompts import load_prompts
from tandem.errors import InvalidParameterError, TandemError

BACKENDS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
# (what, the client's result key, the server's metric, scale server -> client units)
COMPARED = (
    ("mean TTFT ms", "mean_ttft_ms", "tandem:time_to_first_token_seconds", 1000.0),
    ("mean ITL ms", "mean_itl_ms", "tandem:inter_token_latency_seconds", 1000.0),
    ("mean TPOT ms", "mean_tpot_ms", "tandem:request_time_per_output_token_seconds", 1000.0),
    ("mean end-to-end latency ms", "mean_e2el_ms", "tandem:e2e_request_latency_seconds", 1000.0),
)


@dataclass(frozen=True)
class ClientCheckConfig:
    model: str = "smollm2-135m"
    backend: str = "openai-chat"
    num_prompts: int = 60
    concurrency: int = 60
    input_len: int = 128
    max_tokens: int = 96
    threads: int = 2
    max_model_len: int = 1024
    vllm_python: str | None = None
    ready_timeout_s: float = 300.0
    client_timeout_s: float = 900.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidParameterError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if min(self.num_prompts, self.concurrency, self.input_len, self.max_tokens, self.threads) < 1:
            raise InvalidParameterError("num_prompts, concurrency, input_len, max_tokens and threads must be >= 1")


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels summed): e.g. "tandem:time_to_first_token_seconds_sum"."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def server_side(before: dict, after: dict, duration_s: float) -> dict:
    """The server's view of the run: histogram means (delta _sum / delta _count) and counter deltas."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {}
    for label, _, metric, scale in COMPARED:
        count = delta(metric + "_count")
        out[label] = round(delta(metric + "_sum") / count * scale, 3) if count else None
    tokens = delta("tandem:generation_tokens_total")
    out["output tokens"] = int(tokens)
    out["output tok/s"] = round(tokens / duration_s, 2) if duration_s else None
    out["requests"] = int(delta("tandem:request_success_total"))
    return out


def client_side(result: dict) -> dict:
    out = {label: round(result[key], 3) if result.get(key) is not None else None for label, key, _, _ in COMPARED}
    out["output tokens"] = result.get("total_output_tokens")
    out["output tok/s"] = round(result["output_throughput"], 2) if result.get("output_throughput") is not None else None
    out["requests"] = result.get("completed")
    return out


def compare(client: dict, server: dict) -> dict:
    """server / client for each figure both have."""
    return {k: round(server[k] / client[k], 3) if client.get(k) and server.get(k) is not None else None for k in client}


def client_command(config: ClientCheckConfig, python: Path, url: str, model_dir: Path, result_dir: Path) -> list[str]:
    worker = Path(__file__).with_name("vllm_client_worker.py")
    return [str(python), str(worker), "--backend", config.backend, "--base-url", url, "--endpoint", BACKENDS[config.backend],
            "--model", SERVED, "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(config.input_len),
            "--random-output-len", str(config.max_tokens), "--num-prompts", str(config.num_prompts), "--max-concurrency", str(config.concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", "7", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", "client.json"]


def run_client(config: ClientCheckConfig, url: str, model_dir: Path, log_dir: Path) -> dict:
    python = vllm_python(config.vllm_python)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")} | {"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                                                                                          "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log = log_dir / "vllm-client.log"
    with open(log, "wb") as out:
        code = subprocess.run(client_command(config, python, url, model_dir, log_dir), env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=config.client_timeout_s).returncode
    result = log_dir / "client.json"
    if code != 0 or not result.exists():
        raise TandemError(f"vLLM's benchmark client failed (exit code {code}); the end of its log {log}:\n{log_tail(log)}")
    return json.loads(result.read_text())


def run_client_check(config: ClientCheckConfig, progress=print) -> dict:
    from tandem.models.zoo import resolve_model

    model_dir = resolve_model(config.model)
    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-vllm-client-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = tandem_serve_command(config.model, port, config.threads, ["--served-model-name", SERVED, "--max-model-len", str(config.max_model_len)])
    with sigterm_as_interrupt(), ChildServer("tandem serve", cmd, port, log_dir / "tandem.log", tandem_env(config.threads), ready_path="/ready",
                                             timeout_s=config.ready_timeout_s) as server:
        warm_up(server, [p.prompt for p in load_prompts("builtin", per_domain=1, split="test")], config.max_tokens)
        before = scrape(server.url)
        progress(f"running vLLM's benchmark client ({config.backend}, {config.num_prompts} prompts, concurrency {config.concurrency})")
        result = run_client(config, server.url, model_dir, log_dir)
        after = scrape(server.url)
    client = client_side(result)
    server_view = server_side(before, after, result["duration"])
    return {"config": asdict(config), "machine": machine_info(), "log_dir": str(log_dir), "client_duration_s": result["duration"],
            "client_failed": result.get("failed"), "client": client, "server": server_view, "server_over_client": compare(client, server_view)}


def markdown_table(report: dict) -> str:
    c, s, r = report["client"], report["server"], report["server_over_client"]
    lines = ["| figure | vLLM's client | tandem /metrics | server / client |", "|---|---|---|---|"]
    lines += [f"| {k} | {c[k]} | {s.get(k)} | {r.get(k)} |" for k in c]
    return "\n".join(lines)


def config_from_args(args) -> ClientCheckConfig:
    concurrency = int(args.concurrency.split(",")[-1]) if args.concurrency else ClientCheckConfig.concurrency
    return ClientCheckConfig(model=args.model, backend=args.vllm_client, num_prompts=args.num_prompts, concurrency=concurrency,
                             input_len=args.input_len, max_tokens=args.max_tokens, threads=args.threads or 2, max_model_len=args.max_model_len,
                             vllm_python=args.vllm_python, log_dir=args.log_dir)
