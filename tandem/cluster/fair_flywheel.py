"""The fair live flywheel: serving and training on separate cores, online vs static on a domain-shifting stream.

    python -m tandem.cluster.netns --ray-local -- python -m tandem.cluster.fair_flywheel --requests 300 --block 30

Both arms serve the same stream (`domain_stream`: blocks of `--block` requests per domain, cycling through the
five built-in domains) through one engine replica actor pinned to `--serve-core` with `--concurrency` requests in
flight, EAGLE drafting from the same starting head. Static: no trainer. Online: the trainer actor pinned to
`--train-core` trains on the replica's traces and the replica hot-swaps its versions. Reported per arm: live
tokens/s over the stream, acceptance length (emitted / drafts), swaps and the slowest swap, lost requests.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import wait
from pathlib import Path

from tandem.config import SamplingParams


def run_arm(name: str, config, stream: list[list[int]], params: SamplingParams, concurrency: int, serve_core: int, trainer_spec=None) -> dict:
    from tandem.cluster.flywheel_cluster import FlywheelCluster, ReplicaFailed
    from tandem.cluster.specs import Placement

    cluster = FlywheelCluster(config, replicas=1, trainer=trainer_spec, replica_placement=Placement(num_cpus=1, cores=(serve_core,))).start()
    try:
        before = cluster.status()[0]["engine"]
        tokens, lost, pending, started = 0, 0, set(), time.perf_counter()
        for ids in stream:
            if len(pending) >= concurrency:
                done, pending = wait(pending, return_when="FIRST_COMPLETED")
                for f in done:
                    try:
                        tokens += len(f.result()["token_ids"])
                    except ReplicaFailed:
                        lost += 1
            pending.add(cluster.submit(ids, params, replica=0))
        for f in pending:
            try:
                tokens += len(f.result()["token_ids"])
            except ReplicaFailed:
                lost += 1
        wall = time.perf_counter() - started
        status = cluster.status()[0]
        after = status["engine"]
        drafts = after["drafts"] - before["drafts"]
        emitted = after["emitted_tokens"] - before["emitted_tokens"]
        return {"arm": name, "requests": len(stream), "tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
                "acceptance_length": round(emitted / drafts, 4) if drafts else None, "lost_requests": lost, "swaps": status["swaps"],
                "trainer": cluster.trainer_status() if trainer_spec is not None else None}
    finally:
        cluster.close()


def main(argv=None) -> int:
    from tandem.cluster.ray_env import connect, shutdown
    from tandem.cluster.results import write_result
    from tandem.cluster.specs import Placement, TrainerSpec
    from tandem.data.prompts import DOMAINS, domain_stream, load_prompts, render_chat
    from tandem.flywheel.trainer import FlywheelConfig
    from tandem.llm import load_tokenizer
    from tandem.models.zoo import resolve_model
    from tandem.server.runtime import ServerConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter-path", default=str(Path(__file__).resolve().parents[1] / "heads" / "eagle-smollm2"))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--block", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--serve-core", type=int, default=0)
    p.add_argument("--train-core", type=int, default=1)
    p.add_argument("--publish-every", type=int, default=10)
    p.add_argument("--state-dir", default="/tmp/tandem-fair-flywheel")
    p.add_argument("--arms", default="static,online")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model(args.model))
    stream = render_chat(domain_stream(load_prompts("builtin", DOMAINS), args.requests, args.block, DOMAINS), tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    base = dict(model=args.model, drafter="eagle", drafter_path=args.drafter_path, max_batch_size=args.concurrency, threads=1)
    spec = TrainerSpec(model=args.model, drafter_path=args.drafter_path, loss=FlywheelConfig(publish_every=args.publish_every),
                       state_dir=f"{args.state_dir}/{time.time_ns()}", placement=Placement(num_cpus=1, cores=(args.train_core,)))
    connect(num_cpus=2, worker_niceness=0)
    results = []
    try:
        for arm in args.arms.split(","):
            online = arm == "online"
            config = ServerConfig(**base, online=online)
            results.append(run_arm(arm, config, stream, params, args.concurrency, args.serve_core, spec if online else None))
            print(json.dumps(results[-1]), flush=True)
    finally:
        shutdown()
    by = {r["arm"]: r for r in results}
    figures = {"arms": results}
    if "static" in by and "online" in by:
        figures["online_over_static_tok_s"] = round(by["online"]["tok_s"] / by["static"]["tok_s"], 4)
    write_result("python -m tandem.cluster.fair_flywheel", args, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
