"""Scenarios on a real local Ray cluster, run by tests/cluster/test_*.py inside a private network namespace.

`python tests/cluster/scenarios.py MODEL_DIR WORK_DIR OUT_JSON [scenario ...]` starts Ray (num_cpus=2, no
dashboard), runs each scenario against it, writes every scenario's observations (or its traceback) to
OUT_JSON and shuts Ray down. The tests assert on those observations.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_helpers

from tiny_helpers import GREEDY, make_prompts, plain_outputs  # noqa: E402

from tandem.cluster.flywheel_cluster import FlywheelCluster, ReplicaFailed  # noqa: E402
from tandem.cluster.ray_env import connect, shutdown  # noqa: E402
from tandem.cluster.specs import Placement, TrainerSpec  # noqa: E402
from tandem.config import SamplingParams  # noqa: E402
from tandem.flywheel.trainer import FlywheelConfig  # noqa: E402
from tandem.server.runtime import ServerConfig  # noqa: E402

HALF = Placement(num_cpus=0.5, max_restarts=2)


def _server_config(model: str, **kw) -> ServerConfig:
    base = dict(model=model, served_model_name="tiny", max_batch_size=4, max_queue=64, max_model_len=128, threads=1, drafter="eagle", draft_vocab_size=200)
    return ServerConfig(**(base | kw))


def _serve_until(cluster, predicate, timeout: float, seed: int = 100) -> bool:
    """Keep traffic flowing (swaps happen between a replica's steps) until predicate() holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        cluster.generate(make_prompts(4, seed=seed), GREEDY)
        seed += 1
    return predicate()


def flywheel(model: str, work: Path) -> dict:
    out: dict = {"phase_s": {}}
    mark = [time.monotonic()]

    def phase(name):
        now = time.monotonic()
        out["phase_s"][name] = round(now - mark[0], 2)
        mark[0] = now

    spec = TrainerSpec(model=model, draft_vocab_size=200, loss=FlywheelConfig(publish_every=2, min_traces=2), state_dir=str(work / "trainer"),
                       checkpoint_every=2, placement=HALF)
    config = _server_config(model, online=True)
    with FlywheelCluster(config, replicas=2, trainer=spec, replica_placement=HALF, poll_s=0.1) as cluster:
        phase("start")
        start = cluster.versions()
        out["initial_versions"] = start
        prompts = make_prompts(8, seed=3)
        first = cluster.generate(prompts, GREEDY)
        out["first_lossless"] = [r["token_ids"] for r in first] == plain_outputs(model, prompts, [GREEDY] * 8)
        out["first_replicas"] = sorted({r["replica"] for r in first})
        out["swapped_both"] = _serve_until(cluster, lambda: all(v is not None and v > start[0] for v in cluster.versions()), 90)
        status = cluster.status()
        out["versions_after_swap"] = [s["version"] for s in status]
        out["swaps"] = [s["swaps"]["swaps"] for s in status]
        out["refused"] = [s["swaps"]["refused"] for s in status]
        later = make_prompts(4, seed=7)
        out["after_swap_lossless"] = [r["token_ids"] for r in cluster.generate(later, GREEDY)] == plain_outputs(model, later, [GREEDY] * 4)
        out["trainer"] = cluster.trainer_status()
        phase("swap")
        out.update(_kill_replica(cluster, model))
        phase("kill_replica")
        out.update(_kill_trainer(cluster, model))
        phase("kill_trainer")
        final = cluster.status()
        out["trace_counts"] = [s["flywheel"]["traces_sent"] for s in final]
    return out


def _kill_replica(cluster, model: str) -> dict:
    out: dict = {}
    victim = cluster.status()[0]
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    doomed = [cluster.submit(p, long, replica=0) for p in make_prompts(6, seed=11)]
    time.sleep(0.3)
    os.kill(victim["pid"], signal.SIGKILL)
    began = time.monotonic()
    survivors = make_prompts(4, seed=12)
    served = [cluster.submit(p, GREEDY, replica=1) for p in survivors]
    outcomes = []
    for f in doomed:
        try:
            r = f.result(timeout=120)
            outcomes.append({"ok": len(r["token_ids"])})
        except ReplicaFailed as e:
            outcomes.append({"error": str(e)})
    out["killed_replica_outcomes"] = outcomes
    out["killed_replica_resolved_s"] = round(time.monotonic() - began, 2)
    out["other_replica_lossless"] = [f.result(timeout=120)["token_ids"] for f in served] == plain_outputs(model, survivors, [GREEDY] * 4)
    out["replica_restarted"] = cluster.wait_until(lambda: (s := cluster.status(timeout=5)[0]) is not None and s["pid"] != victim["pid"], 120)
    newest = cluster.trainer_status()["published"]
    out["restarted_caught_up"] = _serve_until(cluster, lambda: (cluster.versions()[0] or 0) >= newest, 60, seed=200)
    return out


def _kill_trainer(cluster, model: str) -> dict:
    import ray

    out: dict = {}
    saved = ray.get(cluster.trainer.save_checkpoint.remote(), timeout=120)
    before = cluster.trainer_status()
    out["checkpoint_step"] = int(Path(saved).name.split("-")[1])
    out["steps_before_kill"] = before["steps"]
    held = cluster.versions()
    os.kill(before["pid"], signal.SIGKILL)
    time.sleep(0.5)
    during = make_prompts(4, seed=21)
    results = cluster.generate(during, GREEDY)
    out["served_while_trainer_dead"] = [r["token_ids"] for r in results] == plain_outputs(model, during, [GREEDY] * 4)
    out["versions_held"], out["versions_during"] = held, cluster.versions()
    out["trainer_restarted"] = cluster.wait_until(lambda: (s := cluster.trainer_status(5)) is not None and s["pid"] != before["pid"], 120)
    after = cluster.trainer_status()
    out["resumed_from_step"], out["restored_traces"], out["lost_with_buffer"] = after["resumed_from_step"], after["restored_traces"], after["lost_with_buffer"]
    out["held_before_kill"] = before["buffer"]["traces"]
    out["spilled_before_kill"] = before["buffer"]["spilled"]
    out["first_published_after_restart"] = first = after["first_version"]
    out["adopted_after_restart"] = _serve_until(cluster, lambda: all((v or 0) >= first for v in cluster.versions()), 90, seed=300)
    out["versions_final"] = cluster.versions()
    return out


SCENARIOS = {"flywheel": flywheel}


def main() -> int:
    model, work, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    names = sys.argv[4:] or list(SCENARIOS)
    results: dict = {}
    began = time.monotonic()
    connect(num_cpus=2)
    results["ray_start_s"] = round(time.monotonic() - began, 2)
    try:
        for name in names:
            t0 = time.monotonic()
            try:
                results[name] = SCENARIOS[name](model, work / name)
            except Exception:  # noqa: BLE001 - recorded for the test to report
                results[name] = {"traceback": traceback.format_exc()}
            results[name]["seconds"] = round(time.monotonic() - t0, 2)
            target.write_text(json.dumps(results, indent=1, default=str))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
