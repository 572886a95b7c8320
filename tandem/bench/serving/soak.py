"""`tandem bench soak`: hours of production traffic in minutes, checking for hangs and growth, not speed.

A `tandem serve` composition with two injected faults runs in a child process (tandem.bench.serving.soak_server) with a
drafter whose weights are re-published every few seconds through the admin API (`POST /admin/drafter/adopt`:
the validated hot-swap path; or, with `online`, the flywheel's trainer publishes). `concurrency` clients send
streaming chat and completion requests (greedy and sampled, random lengths) for `minutes`; some disconnect at
random mid-stream. At a third of the run one request carries the prefill marker (its prefill raises), at two
thirds one carries the step marker (the step running it raises, failing every request of that step). Every
`sample_every_s` the server process's RSS and its state directory's size are sampled.

Each request ends as: ok, client_disconnected, 4xx, 5xx (split into the injected prefill's, the injected step's
and unexplained ones, from the engine request ids the faults logged), transport_error, or hung (no end within
the server's request timeout + `hang_margin_s`). The run passes when nothing hung, no 5xx is unexplained, the
faults hit exactly the requests they logged, and neither the server's RSS nor its state directory grew after the
warm-up by more than the bounds of soak_verdict explain (`rss_allowance_mb`, `state_dir_allowance_mb`).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.children import ChildServer, free_port, sigterm_as_interrupt, tandem_env
from tandem.bench.machine import machine_info
from tandem.bench.peers.vllm_client import scrape
from tandem.bench.serving.soak_verdict import (Result, classify, growth, growth_checks, markdown_table, percentile, read_fault_log,
                                               rss_allowance_mb, state_dir_allowance_mb, verdict)
from tandem.data.prompts import load_prompts
from tandem.errors import InvalidParameterError
from tandem.server.runtime import ServerConfig

SERVED = "soak"
ERROR_STATUS = {"server_error": 503, "timeout_error": 408, "invalid_request_error": 400, "rate_limit_error": 429}


@dataclass(frozen=True)
class SoakConfig:
    model: str = "smollm2-135m"
    minutes: float = 20.0
    concurrency: int = 32
    drafter: str = "eagle"  # its weights are what gets re-published (the shipped head where one fits the model)
    drafter_path: str | None = None
    draft_vocab_size: int | None = None  # eagle day-0 head (a model without a shipped head)
    online: bool = False  # the flywheel's trainer publishes versions (instead of the admin API)
    publish_every_s: float = 5.0
    disconnect_prob: float = 0.1  # a streaming client hangs up after 1-8 chunks
    max_tokens: int = 64  # each request asks for a uniform 8..max_tokens
    prompts: str = "builtin"
    warmup_s: float | None = None  # None: 10 % of the run, at most 120 s
    sample_every_s: float = 10.0
    request_timeout_s: float = 120.0  # the server's --request-timeout
    hang_margin_s: float = 30.0
    threads: int | None = 2
    max_batch_size: int | None = None  # None: the server's default (sized from the KV budget)
    max_model_len: int = 2048  # the builtin prompts reach ~1,100 tokens
    state_dir: str | None = None  # None: a temporary directory, removed after the run
    log_dir: str | None = None
    ready_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.concurrency < 1 or self.max_tokens < 8 or self.publish_every_s <= 0 or self.sample_every_s <= 0:
            raise InvalidParameterError("minutes and publish/sample intervals must be > 0, concurrency >= 1, max_tokens >= 8")
        if not 0 <= self.disconnect_prob <= 1:
            raise InvalidParameterError(f"disconnect_prob must be in [0, 1], got {self.disconnect_prob}")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(120.0, 0.1 * self.duration_s)


# ---- one request -----------------------------------------------------------------------------------------
def _error_result(kind: str, status: int, body: dict, response_id: str | None, start: float) -> Result:
    error = body.get("error") or {}
    outcome = "5xx" if status >= 500 else "4xx"
    return Result(kind, outcome, status, error.get("code"), response_id, time.perf_counter() - start, error.get("message"))


async def stream_request(client, path: str, body: dict, kind: str, hang_up_after: int | None = None) -> Result:
    start, response_id, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            return _error_result(kind, r.status_code, _json(raw), None, start)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return Result(kind, "ok", 200, None, response_id, time.perf_counter() - start)
            chunk = json.loads(line[6:])
            if "error" in chunk:  # an error inside the stream: the status it would have had
                return _error_result(kind, ERROR_STATUS.get(chunk["error"].get("type"), 500), chunk, response_id, start)
            response_id = response_id or chunk.get("id")
            chunks += bool(chunk.get("choices"))
            if hang_up_after is not None and chunks >= hang_up_after:
                return Result(kind, "client_disconnected", 200, None, response_id, time.perf_counter() - start)
    return Result(kind, "transport_error", 200, None, response_id, time.perf_counter() - start, "the stream ended without [DONE]")


async def plain_request(client, path: str, body: dict, kind: str) -> Result:
    start = time.perf_counter()
    r = await client.post(path, json=body)
    data = _json(r.content)
    if r.status_code != 200:
        return _error_result(kind, r.status_code, data, None, start)
    return Result(kind, "ok", 200, None, data.get("id"), time.perf_counter() - start)


def _json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


async def guarded(coro, kind: str, limit_s: float) -> Result:
    """The request's result, or `hung` past limit_s, or a transport error."""
    import httpx

    start = time.perf_counter()
    try:
        return await asyncio.wait_for(coro, limit_s)
    except TimeoutError:
        return Result(kind, "hung", latency_s=time.perf_counter() - start)
    except (httpx.HTTPError, ValueError) as e:
        return Result(kind, "transport_error", latency_s=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")


async def publish_once(client, headers: dict, publishes: dict) -> None:
    """Re-publish the served drafter version through the admin API; a refusal or a transport error (a timeout on a
    starved box included) is counted as a failed publish with its first error, and never ends the soak."""
    import httpx

    try:
        version = (await client.get("/admin/drafter", headers=headers)).json()["version"]
        r = await client.post("/admin/drafter/adopt", json={"version": version}, headers=headers)
        error = None if r.status_code == 200 else f"{r.status_code} {r.text[:300]}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        error = f"{type(e).__name__}: {e}"
    publishes["ok" if error is None else "failed"] += 1
    if error is not None:
        publishes.setdefault("first_error", error)


def load_body(rng: random.Random, prompts: list[str], max_tokens: int) -> tuple[str, dict]:
    """A random request of the load: 80 % chat, 20 % completions, all streaming, greedy or sampled: (path, body)."""
    prompt = rng.choice(prompts)
    body = {"model": SERVED, "max_tokens": rng.randint(8, max_tokens), "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1 << 30),
            "stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.8:
        path, body = "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", body | {"prompt": prompt}
    return path, body


# ---- the run ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    config: SoakConfig
    url: str
    pid: int
    state_dir: Path
    prompts: list[str]
    markers: dict
    admin_key: str
    results: list[Result] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    publishes: dict = field(default_factory=lambda: {"ok": 0, "failed": 0})
    start: float = 0.0

    def limit_s(self) -> float:
        return self.config.request_timeout_s + self.config.hang_margin_s

    async def main(self) -> None:
        import httpx

        c = self.config
        limits = httpx.Limits(max_connections=c.concurrency + 8, max_keepalive_connections=c.concurrency + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.limit_s()), limits=limits) as client:
            self.start = time.monotonic()
            end = self.start + c.duration_s
            tasks = [self._worker(client, i, end) for i in range(c.concurrency)]
            tasks += [self._faults(client), self._sampler(end)] + ([] if c.online else [self._publisher(client, end)])
            await asyncio.gather(*tasks)

    async def _worker(self, client, index: int, end: float) -> None:
        rng = random.Random(f"{self.config.seed}:{index}")
        while time.monotonic() < end:
            path, body = load_body(rng, self.prompts, self.config.max_tokens)
            hang_up = rng.randint(1, 8) if rng.random() < self.config.disconnect_prob else None
            self.results.append(await guarded(stream_request(client, path, body, "load", hang_up), "load", self.limit_s()))

    async def _faults(self, client) -> None:
        c, base = self.config, [10, 11, 12, 13]
        await asyncio.sleep(c.duration_s / 3)
        body = {"model": SERVED, "prompt": base + self.markers["prefill"], "max_tokens": 8, "temperature": 0}
        self.results.append(await guarded(plain_request(client, "/v1/completions", body, "prefill_fault"), "prefill_fault", self.limit_s()))
        await asyncio.sleep(max(0.0, self.start + 2 * c.duration_s / 3 - time.monotonic()))
        body = {"model": SERVED, "prompt": base + self.markers["step"], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        self.results.append(await guarded(stream_request(client, "/v1/completions", body, "step_fault"), "step_fault", self.limit_s()))

    async def _publisher(self, client, end: float) -> None:
        """Every publish_every_s, re-publish the version being served (a new version each time). The served version's file
        is never pruned by the server's retention (the newest 16 are kept), an older one soon is."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        while time.monotonic() + self.config.publish_every_s < end:
            await asyncio.sleep(self.config.publish_every_s)
            await publish_once(client, headers, self.publishes)

    async def _sampler(self, end: float) -> None:
        while True:
            self.samples.append({"t_s": round(time.monotonic() - self.start, 1), "rss_mb": rss_mb(self.pid), "state_dir_mb": dir_mb(self.state_dir)})
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(self.config.sample_every_s, left))


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def dir_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return round(total / (1 << 20), 2)


def largest_file_mb(path: Path) -> float:
    sizes = [p.stat().st_size for p in path.glob("*") if p.is_file()] if path.is_dir() else []
    return round(max(sizes, default=0) / (1 << 20), 3)


def markers(vocab_size: int) -> dict:
    """Token-id sequences no text prompt produces in practice (the vocabulary's last ids, alternating)."""
    v = vocab_size
    return {"prefill": [v - 1, v - 2, v - 1, v - 2], "step": [v - 3, v - 4, v - 3, v - 4]}


def server_spec(c: SoakConfig, port: int, state_dir: Path, admin_key: str) -> dict:
    return {"model": c.model, "served_model_name": SERVED, "drafter": c.drafter, "drafter_path": c.drafter_path,
            "draft_vocab_size": c.draft_vocab_size, "online": c.online, "state_dir": str(state_dir), "port": port, "admin_key": admin_key,
            "max_batch_size": c.max_batch_size, "max_model_len": c.max_model_len, "threads": c.threads,
            "request_timeout_s": c.request_timeout_s, "drain_timeout_s": 10.0}


def run_soak(config: SoakConfig, progress=print) -> dict:
    from tandem.models.zoo import resolve_model

    model_dir = resolve_model(config.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    log_dir = Path(config.log_dir) if config.log_dir else work
    state_dir = Path(config.state_dir) if config.state_dir else work / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    admin_key, port, marks = secrets.token_hex(16), free_port(), markers(vocab)
    spec = {"server": server_spec(config, port, state_dir, admin_key), "prefill_marker": marks["prefill"], "step_marker": marks["step"],
            "fault_log": str(work / "faults.jsonl")}
    (work / "spec.json").write_text(json.dumps(spec))
    prompts = [p.prompt for p in load_prompts(config.prompts)]
    cmd = [sys.executable, "-m", "tandem.bench.serving.soak_server", str(work / "spec.json")]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with sigterm_as_interrupt():
        server = ChildServer("the soak's tandem server", cmd, port, log_dir / "server.log", tandem_env(config.threads), ready_path="/ready",
                             timeout_s=config.ready_timeout_s)
        try:
            progress(f"soak: {config.minutes:g} min at concurrency {config.concurrency}, server pid {server.pid}, work dir {work}")
            run = Run(config, server.url, server.pid, state_dir, prompts, marks, admin_key)
            asyncio.run(run.main())
            metrics = scrape(server.url)
            version_mb = largest_file_mb(state_dir / "versions")
        finally:
            exit_code = server.close()
            if config.state_dir is None:  # the temporary state (drafter versions, up to ~1 GB) goes, the logs stay in `work`
                shutil.rmtree(state_dir, ignore_errors=True)
    faults = read_fault_log(work / "faults.jsonl")
    requests = classify(run.results, faults)
    ok = [r.latency_s for r in run.results if r.outcome == "ok" and r.kind == "load"]
    report = {
        "config": asdict(config), "machine": machine_info(), "started": started, "work_dir": str(work), "requests": requests,
        "hung": requests["by_outcome"].get("hung", 0), "faults": faults,
        "latency_p50_s": percentile(ok, 0.5), "latency_p99_s": percentile(ok, 0.99), "latency_mean_s": round(statistics.fmean(ok), 3) if ok else None,
        "publishes": run.publishes, "server": _server_counts(metrics), "server_exit_code": exit_code,
        "rss_mb": growth(run.samples, "rss_mb", config.warmup), "state_dir_mb": growth(run.samples, "state_dir_mb", config.warmup),
        "samples": run.samples,
    }
    spill_cap_mb = (ServerConfig.spill_max_bytes or 0) / (1 << 20)  # the soak's server runs with the default cap
    allowance = state_dir_allowance_mb(version_mb, config.online, spill_cap_mb)
    report["state_dir_mb"]["allowed"] = round(allowance, 2)
    report["rss_mb"]["allowed_growth"] = None if report["rss_mb"]["warmup_end"] is None else round(rss_allowance_mb(report["rss_mb"]["warmup_end"]), 1)
    report["verdict"] = verdict(requests, faults, run.publishes, growth_checks(report["rss_mb"], report["state_dir_mb"], allowance))
    if config.state_dir is None:
        shutil.rmtree(state_dir, ignore_errors=True)
    return report


def _server_counts(m: dict) -> dict:
    keys = {"drafter_version": "tandem:drafter_version", "drafter_swaps": "tandem:drafter_swaps_total",
            "drafter_refusals": "tandem:drafter_refusals_total", "engine_steps_failed": "tandem:engine_steps_failed_total",
            "engine_prefills_failed": "tandem:engine_prefills_failed_total", "loop_iterations_failed": "tandem:engine_loop_iterations_failed_total",
            "requests_succeeded": "tandem:request_success_total", "generation_tokens": "tandem:generation_tokens_total"}
    return {k: m.get(v) for k, v in keys.items()}


def add_bench_soak_command(bench) -> None:
    d = SoakConfig()
    p = bench.add_parser("soak", help="a long run against `tandem serve` with faults, disconnects and drafter swaps: hangs, 5xx, RSS, disk")
    p.add_argument("--model", default=d.model)
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--drafter", default=d.drafter, help="a drafter with swappable weights (eagle)")
    p.add_argument("--drafter-path", default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--online", action="store_true", help="the flywheel's trainer publishes the versions (instead of the admin API)")
    p.add_argument("--publish-every", type=float, default=d.publish_every_s, help="seconds between admin re-publishes of the drafter")
    p.add_argument("--disconnect-prob", type=float, default=d.disconnect_prob)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--prompts", default=d.prompts)
    p.add_argument("--warmup", type=float, default=None, help="seconds before RSS / disk are taken as the baseline (default 10 %%, <= 120)")
    p.add_argument("--sample-every", type=float, default=d.sample_every_s)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.set_defaults(func=_bench_soak)


def _bench_soak(args) -> int:
    config = SoakConfig(model=args.model, minutes=args.minutes, concurrency=args.concurrency, drafter=args.drafter, drafter_path=args.drafter_path,
                        draft_vocab_size=args.draft_vocab_size, online=args.online, publish_every_s=args.publish_every,
                        disconnect_prob=args.disconnect_prob, max_tokens=args.max_tokens, prompts=args.prompts, warmup_s=args.warmup,
                        sample_every_s=args.sample_every, request_timeout_s=args.request_timeout, threads=args.threads,
                        max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, state_dir=args.state_dir, log_dir=args.log_dir,
                        seed=args.seed)
    report = run_soak(config)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report))
    return 0 if report["verdict"]["passed"] else 1
