"""The Ray path's overhead and its 1 vs 2 replica scaling: the same engine loop embedded and in Ray replica actors.

    python -m tandem.cluster.netns --ray-local -- python -m tandem.cluster.overhead --model smollm2-135m --prompts 60

Arms, all on the same `--prompts` requests submitted at once (greedy, `--max-tokens` each, EOS ignored so every
arm decodes the same tokens), timed to the last token:
- `embedded`: a Runtime's EngineLoop in this process, `--threads` torch threads;
- `ray1`: one EngineReplica actor (the same Runtime) with `--threads` threads, called through Ray from here;
- `ray2`: two EngineReplica actors with `--threads / 2` threads each, replica i pinned to core i (when the
  machine has the cores), requests round-robin over them;
- `ray2_unpinned`: the same two replicas left to the OS scheduler (on a shared machine a pinned replica cannot
  move off a core that a neighbour is using: this arm separates that from the cost of replication; `--arms` adds
  it, as every arm's replicas stay up through the run: memory for five model copies).
Every replica holds its whole share at once (`--max-batch-size`, default all the prompts): replica i's batch is
prompts / replicas, as tandem.sim.replicas models it. Arms alternate `--rounds` times. Reported per arm: each
round's tokens/s and p50 / p99 request latency (submit to last token), the medians, and the ratios to embedded.
The `--probe` pairs (one 1-token request embedded, then the same on ray1, one pair at a time) give the per-request
fixed cost of the Ray path: the median of the pairs' latency differences, the routing overhead that
`tandem simulate --replicas ... --routing-ms` takes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time

from tandem.config import SamplingParams

TOPICS = ("the sea", "a robot", "autumn", "a city at night", "bread", "mountains", "a lost key", "the moon", "trains", "a garden")
TASKS = ("Write a short story about {}.", "Explain {} to a child.", "List facts about {}.", "Describe {} in a poem.", "Give advice about {}.",
         "Summarize the history of {}.")
ARMS = ("embedded", "ray1", "ray2", "ray2_unpinned")


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [TASKS[i % len(TASKS)].format(TOPICS[(i // len(TASKS)) % len(TOPICS)]) for i in range(n)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), math.ceil(q / 100 * len(ordered))) - 1)]


def run_embedded(runtime, batch: list[list[int]], params: SamplingParams) -> tuple[int, float, list[float]]:
    """(tokens, wall seconds, each request's latency) of `batch` submitted at once to the runtime's loop."""
    from tandem.server.engine_loop import Submission

    done, left, tokens, latencies, lock = threading.Event(), [len(batch)], [0], [], threading.Lock()
    start = time.perf_counter()

    def sink(event) -> None:
        with lock:
            tokens[0] += len(event.token_ids)
            if event.finished:
                latencies.append(time.perf_counter() - start)
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for i, ids in enumerate(batch):
        runtime.loop.submit([Submission(f"b{time.monotonic_ns()}-{i}", 0, ids, params)], sink)
    done.wait()
    return tokens[0], time.perf_counter() - start, latencies


def run_ray(cluster, batch: list[list[int]], params: SamplingParams) -> tuple[int, float, list[float]]:
    """The same through a FlywheelCluster (round-robin over its replicas)."""
    start, latencies = time.perf_counter(), []
    futures = [cluster.submit(ids, params) for ids in batch]
    for f in futures:
        f.add_done_callback(lambda _: latencies.append(time.perf_counter() - start))
    tokens = sum(len(f.result()["token_ids"]) for f in futures)
    return tokens, time.perf_counter() - start, latencies


def probe(runtime, cluster, batch: list[list[int]], n: int) -> dict:
    """`n` pairs of single 1-token requests, embedded then through `cluster`, one at a time: the medians and the
    median of the pairs' differences (pairs taken back to back see the same neighbours on a shared machine)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pairs = [(run_embedded(runtime, [batch[i % len(batch)]], params)[1], run_ray(cluster, [batch[i % len(batch)]], params)[1]) for i in range(n)]
    return {"embedded_s": round(statistics.median(a for a, _ in pairs), 4), "ray1_s": round(statistics.median(b for _, b in pairs), 4),
            "ray_overhead_ms_per_request": round(1000 * statistics.median(b - a for a, b in pairs), 2), "pairs": n}


def _clusters(config, threads: int, arms: list[str]):
    from dataclasses import replace

    from tandem.cluster.flywheel_cluster import FlywheelCluster
    from tandem.cluster.specs import Placement

    cores = sorted(os.sched_getaffinity(0))
    pinned = [(cores[0],), (cores[1],)] if len(cores) >= 2 else None
    half = replace(config, threads=max(1, threads // 2))
    build = {"ray1": lambda: FlywheelCluster(config, replicas=1, replica_placement=Placement(num_cpus=1)),
             "ray2": lambda: FlywheelCluster(half, replicas=2, replica_placement=Placement(num_cpus=1), replica_cores=pinned),
             "ray2_unpinned": lambda: FlywheelCluster(half, replicas=2, replica_placement=Placement(num_cpus=1))}
    return {arm: build[arm]().start() for arm in arms if arm != "embedded"}


def summarize(rounds: dict[str, list[dict]]) -> dict:
    med = {arm: {"tok_s": round(statistics.median(r["tok_s"] for r in rs), 2), "p50_s": round(statistics.median(r["p50_s"] for r in rs), 3)}
           for arm, rs in rounds.items()}
    base = med["embedded"]
    ratios = {arm: {"tok_s": round(m["tok_s"] / base["tok_s"], 4), "p50": round(m["p50_s"] / base["p50_s"], 4)} for arm, m in med.items() if arm != "embedded"}
    return {"median": med, "over_embedded": ratios, "over_ray1_tok_s": {arm: round(med[arm]["tok_s"] / med["ray1"]["tok_s"], 4) for arm in med if arm.startswith("ray2")}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=0, help="per replica (0: all the prompts, so each replica holds its whole share)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="embedded and ray1; ray2 gets half per replica")
    p.add_argument("--arms", default="embedded,ray1,ray2", help=f"comma list of {', '.join(ARMS)} (embedded and ray1 always run)")
    p.add_argument("--probe", type=int, default=40, help="pairs of 1-token requests (embedded, ray1) for the per-request overhead (0: none)")
    p.add_argument("--json", default=None)
    return p


def main(argv=None) -> int:
    from tandem.cluster.ray_env import connect, shutdown
    from tandem.cluster.results import write_result
    from tandem.server.runtime import Runtime, ServerConfig

    args = _parser().parse_args(argv)
    arms = list(dict.fromkeys(["embedded", "ray1"] + [a for a in args.arms.split(",") if a]))
    if set(arms) - set(ARMS):
        raise SystemExit(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; known: {', '.join(ARMS)}")
    capacity = args.max_batch_size or args.prompts
    config = ServerConfig(model=args.model, drafter=args.drafter, max_batch_size=capacity, max_queue=max(64, args.prompts), threads=args.threads,
                          max_model_len=64 + args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    connect(num_cpus=6, worker_niceness=0)  # logical CPUs: every arm's replicas stay up between rounds (an idle one sleeps); threads and cores set the real use
    runtime = Runtime(config)
    batch = prompts(runtime.tokenizer, args.prompts)
    rounds: dict[str, list[dict]] = {arm: [] for arm in arms}
    clusters, probes, placed = {}, {}, {}
    try:
        clusters = _clusters(config, args.threads, arms)
        targets = {"embedded": (run_embedded, runtime)} | {arm: (run_ray, cluster) for arm, cluster in clusters.items()}
        for fn, target in targets.values():
            fn(target, batch[:4], params)  # warm every replica (first forwards, allocations)
        for _ in range(args.rounds):
            for arm in arms:
                fn, target = targets[arm]
                tokens, wall, latencies = fn(target, batch, params)
                rounds[arm].append({"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
                                    "p50_s": round(percentile(latencies, 50), 3), "p99_s": round(percentile(latencies, 99), 3)})
                print(json.dumps({arm: rounds[arm][-1]}), flush=True)
        placed = {arm: [{"cores": st["cores"], "pid": st["pid"]} for st in clusters[arm].status()] for arm in clusters}
        if args.probe:
            probes = probe(runtime, clusters["ray1"], batch, args.probe)
    finally:
        for cluster in clusters.values():
            cluster.close()
        runtime.close()
        shutdown()
    write_result("python -m tandem.cluster.overhead", args, {"driver_cores": sorted(os.sched_getaffinity(0)), "replicas": placed, "rounds": rounds,
                                                            **summarize(rounds), "probe": probes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
