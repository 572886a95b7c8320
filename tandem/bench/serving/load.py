"""The load generator of the serving benchmarks: concurrent streaming chat clients against an OpenAI-compatible server,
one result per request (tokens, latency, time to first token), and a level's summary."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    ttft_s: float | None
    output_tokens: int
    acceptance_length: float | None
    prompt_tokens: int = 0


async def _one(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestResult(False, time.perf_counter() - start, None, 0, None)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return RequestResult(False, time.perf_counter() - start, ttft, 0, None)
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
    latency = time.perf_counter() - start
    if usage is None:
        return RequestResult(False, latency, ttft, 0, None)
    spec = usage.get("spec_decode") or {}  # tandem's extension; other servers (vLLM) have none
    return RequestResult(True, latency, ttft, usage["completion_tokens"], spec.get("acceptance_length"), usage.get("prompt_tokens", 0))


async def _guarded(request, timeout_s: float | None) -> RequestResult:
    """A request that raised (connection refused or reset: the server died) or ran past timeout_s is a failed one."""
    import httpx

    start = time.perf_counter()
    try:
        return await asyncio.wait_for(request, timeout_s)
    except (httpx.HTTPError, TimeoutError, ValueError):
        return RequestResult(False, time.perf_counter() - start, None, 0, None)


async def _level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                 timeout_s: float | None = None) -> tuple[list[RequestResult], float]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def worker():
            while not queue.empty():
                results.append(await _guarded(_one(client, model, queue.get_nowait(), max_tokens), timeout_s))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(round(q * (len(values) - 1))))], 4)


def summarize(mode: str, concurrency: int, results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    lengths = [r.acceptance_length for r in ok if r.acceptance_length]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "mode": mode, "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok), "output_tokens": tokens,
        "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2) if wall_s else 0.0,
        "latency_p50_s": _percentile([r.latency_s for r in ok], 0.5), "latency_p99_s": _percentile([r.latency_s for r in ok], 0.99),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
        "ttft_p50_s": _percentile([r.ttft_s for r in ok if r.ttft_s is not None], 0.5),
        "ttft_p99_s": _percentile([r.ttft_s for r in ok if r.ttft_s is not None], 0.99),
        "mean_acceptance_length": round(statistics.fmean(lengths), 3) if lengths else None,
    }
