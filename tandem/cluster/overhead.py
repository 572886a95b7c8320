"""The Ray path's overhead: the same engine loop embedded vs in one Ray replica actor, same prompts.

    python -m tandem.cluster.netns --ray-local -- python -m tandem.cluster.overhead --model smollm2-135m --prompts 60

Each arm submits `--prompts` requests at once (greedy, `--max-tokens` each, EOS ignored so both decode the
same tokens) and times them to the last token: embedded = a Runtime's EngineLoop in this process; Ray = an
EngineReplica actor (the same Runtime) called through Ray from this process. Arms alternate `--rounds`
times; the JSON has every round's tokens/s and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from tandem.config import SamplingParams

TOPICS = ("the sea", "a robot", "autumn", "a city at night", "bread", "mountains", "a lost key", "the moon", "trains", "a garden")
TASKS = ("Write a short story about {}.", "Explain {} to a child.", "List facts about {}.", "Describe {} in a poem.", "Give advice about {}.",
         "Summarize the history of {}.")


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [TASKS[i % len(TASKS)].format(TOPICS[(i // len(TASKS)) % len(TOPICS)]) for i in range(n)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run_embedded(runtime, batch: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    from tandem.server.engine_loop import Submission

    done, left, tokens, lock = threading.Event(), [len(batch)], [0], threading.Lock()

    def sink(event) -> None:
        with lock:
            tokens[0] += len(event.token_ids)
            if event.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    start = time.perf_counter()
    for i, ids in enumerate(batch):
        runtime.loop.submit([Submission(f"b{time.monotonic_ns()}-{i}", 0, ids, params)], sink)
    done.wait()
    return tokens[0], time.perf_counter() - start


def run_ray(cluster, batch: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    results = cluster.generate(batch, params)
    return sum(len(r["token_ids"]) for r in results), time.perf_counter() - start


def main(argv=None) -> int:
    from tandem.cluster.flywheel_cluster import FlywheelCluster
    from tandem.cluster.ray_env import connect, shutdown
    from tandem.cluster.specs import Placement
    from tandem.server.runtime import Runtime, ServerConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = ServerConfig(model=args.model, drafter=args.drafter, max_batch_size=args.max_batch_size, max_queue=max(64, args.prompts), threads=args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    connect(num_cpus=2)
    runtime = Runtime(config)
    batch = prompts(runtime.tokenizer, args.prompts)
    cluster = FlywheelCluster(config, replicas=1, replica_placement=Placement(num_cpus=1)).start()
    rounds = {"embedded": [], "ray": []}
    try:
        run_embedded(runtime, batch[:4], params), run_ray(cluster, batch[:4], params)  # warm both (first forwards, allocations)
        for _ in range(args.rounds):
            for name, fn, target in (("embedded", run_embedded, runtime), ("ray", run_ray, cluster)):
                tokens, wall = fn(target, batch, params)
                rounds[name].append({"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2)})
                print(json.dumps({name: rounds[name][-1]}), flush=True)
    finally:
        cluster.close()
        runtime.close()
        shutdown()
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in rounds.items()}
    result = {"command": "python -m tandem.cluster.overhead", "args": vars(args), "rounds": rounds, "median_tok_s": med,
              "ray_over_embedded": round(med["ray"] / med["embedded"], 4), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(result, indent=1))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
