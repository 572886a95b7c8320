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
RESTART_S = 300  # a restarted actor imports torch and loads the model again: seconds here, minutes on a crowded box


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
        cluster.wait_until(lambda: all(s is not None and s["flywheel"]["traces_sent"]["pending"] == 0 for s in cluster.status()), 30)
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
    restarted = cluster.wait_until(lambda: (s := cluster.status(timeout=5)[0]) is not None and s["pid"] != victim["pid"], RESTART_S)
    out["replica_restarted"], out["replica_restart_s"] = restarted, round(time.monotonic() - began, 2)
    if not restarted:
        return out
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
    out["trainer_restarted"] = cluster.wait_until(lambda: (s := cluster.trainer_status(5)) is not None and s["pid"] != before["pid"], RESTART_S)
    if not out["trainer_restarted"]:
        return out
    after = cluster.trainer_status()
    out["resumed_from_step"], out["restored_traces"], out["lost_with_buffer"] = after["resumed_from_step"], after["restored_traces"], after["lost_with_buffer"]
    out["held_before_kill"] = before["buffer"]["traces"]
    out["spilled_before_kill"] = before["buffer"]["spilled"]
    out["first_published_after_restart"] = first = after["first_version"]
    out["adopted_after_restart"] = _serve_until(cluster, lambda: all((v or 0) >= first for v in cluster.versions()), 90, seed=300)
    out["versions_final"] = cluster.versions()
    return out


def parity_reward(text, problem, env):  # gives the tiny random model's groups reward variance (as tests/rl)
    return float(len(text) % 2)


def rl(model: str, work: Path) -> dict:
    """One GRPO step, embedded vs 2 rollout workers and a learner actor: the same rollouts before and after the update."""
    import ray

    from tandem.cluster.rl import build_ray_trainer
    from tandem.rl.grpo import GRPOConfig
    from tandem.rl.setup import build_trainer

    from tandem.rl.envs import EnvConfig

    env = EnvConfig(("basic_arithmetic", "chain_sum"), {}, demonstration=False)  # short questions: the tiny model's 512 positions
    cfg = GRPOConfig(steps=1, prompts_per_step=3, group_size=3, max_tokens=8, lr=1e-3, micro_batch=4, eval_problems=0, seed=1, env=env)
    trainers = {"embedded": build_trainer(model, ["ngram"], cfg, num_draft_tokens=3, adaptive_k=False, reward_fn=parity_reward),
                "ray": build_ray_trainer(model, "ngram", cfg, workers=2, num_draft_tokens=3, adaptive_k=False, reward_fn=parity_reward,
                                         placement=Placement(num_cpus=0.5), learner_placement=Placement(num_cpus=0.5))}
    out: dict = {}
    for name, trainer in trainers.items():
        problems, batches = trainer.rollouts(0)
        trainer.update(batches["ngram"], problems, 0)
        sync = trainer.sync()
        _, after = trainer.rollouts(1)
        out[name] = {"rollouts": [_rollout_view(r) for r in batches["ngram"].rollouts], "after": [_rollout_view(r) for r in after["ngram"].rollouts],
                     "policy_version": trainer.engines[0].policy_version, "sync": sync["sync"], "learner": type(trainer.learner).__name__,
                     "learner_pid": ray.get(trainer.learner.actor.status.remote())["pid"] if name == "ray" else os.getpid(),
                     "driver_pid": os.getpid(), "learner_version": trainer.learner.version}
    return out


def rl_argv(model: str) -> tuple[list[str], list[str]]:
    """`tandem rl` of a tiny run (2 steps of 9 rollouts, 8 tokens each), embedded and on Ray (2 workers, a learner)."""
    common = ["rl", "--model", model, "--drafters", "ngram", "--no-adaptive-k", "--num-draft-tokens", "3", "--prompts-per-step", "3",
              "--group-size", "3", "--max-tokens", "8", "--lr", "1e-3", "--micro-batch", "4", "--eval-problems", "4", "--eval-every", "1",
              "--seed", "1", "--task", "basic_arithmetic,chain_sum", "--no-demonstration", "--reward", "scenarios:parity_reward"]
    return common, common + ["--ray", "--rollout-workers", "2", "--worker-cpus", "0.5", "--learner-cpus", "0.5"]


def rl_resume(model: str, work: Path) -> dict:
    """`tandem rl --ray --checkpoint`: 2 steps at once; 1 step, then --resume to --steps 2; and the embedded run."""
    from tandem.cli import main as cli

    common, on_ray = rl_argv(model)
    runs = {"whole": on_ray + ["--steps", "2", "--checkpoint", str(work / "whole")],
            "first": on_ray + ["--steps", "1", "--checkpoint", str(work / "split")],
            "resumed": on_ray + ["--steps", "2", "--resume", str(work / "split"), "--checkpoint", str(work / "split")],
            "embedded": common + ["--steps", "2", "--checkpoint", str(work / "embedded")]}
    out: dict = {}
    for name, argv in runs.items():
        t0 = time.monotonic()
        rc = cli(argv + ["--json", str(work / f"{name}.json")])
        result = json.loads((work / f"{name}.json").read_text())
        out[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 2), "command": result["command"], "ray": result["config"]["ray"],
                     "history": [{k: h[k] for k in ("step", "policy_version", "reward_mean", "tokens", "rollout_tokens", "step_wall_s")} for h in result["history"]],
                     "evals": [{k: e[k] for k in ("step", "policy_version", "greedy", "sampled", "greedy_tokens_mean", "sampled_tokens_mean")}
                               for e in result["evals"]]}
    out["policy_max_abs_diff"] = {name: _policy_diff(work / "whole", work / other) for name, other in (("resumed", "split"), ("embedded", "embedded"))}
    out["checkpoint_step"] = {name: json.loads((work / name / "state.json").read_text())["step"] for name in ("whole", "split", "embedded")}
    return out


def _policy_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "policy.safetensors")), load_file(str(b / "policy.safetensors"))
    assert set(x) == set(y)
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def _rollout_view(r) -> dict:
    return {"prompt_index": r.prompt_index, "sample_index": r.sample_index, "seed": r.seed, "completion_ids": r.completion_ids,
            "logprobs": list(r.logprobs), "policy_version": r.policy_version}


def serve_scenario(model: str, work: Path) -> dict:
    """tandem serve --ray with 2 replicas: the openai client, streaming, keys, /metrics of every replica."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from tandem.cluster import serve as ray_serve

    key, out = "test-key-0123456789", {}
    config = _server_config(model, api_key=key, port=8000, online=True)  # --online: the trainer actor beside the Serve replicas
    spec = TrainerSpec(model=model, draft_vocab_size=200, loss=FlywheelConfig(publish_every=2, min_traces=2), state_dir=str(work / "trainer"),
                       checkpoint_every=50, placement=Placement(num_cpus=0.25))
    t0 = time.monotonic()
    deployed = ray_serve.start(config, replicas=2, trainer_spec=spec, replica_cpus=0.5)
    trainer = deployed.trainer
    out["start_s"] = round(time.monotonic() - t0, 2)
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=key, max_retries=0, timeout=120)
        prompts = make_prompts(8, seed=31)
        reference = plain_outputs(model, prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 8)
        from tandem.llm import load_tokenizer

        tokenizer = load_tokenizer(model)
        out["expected"] = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference]

        def ask(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            out["texts"] = list(pool.map(ask, prompts))
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        out["streamed"] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        bad = httpx.post("http://127.0.0.1:8000/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer wrong-key-000"})
        out["bad_key"] = {"status": bad.status_code, "body": bad.json()}
        unknown = client.with_options(max_retries=0)
        try:
            unknown.completions.create(model="nope", prompt="x", max_tokens=2)
        except openai.NotFoundError as e:
            out["unknown_model"] = {"status": e.status_code, "body": e.body}
        import ray

        deadline = time.monotonic() + 30  # every finished request's trace reaches the trainer actor
        while ray.get(trainer.status.remote())["buffer"]["added"] < 9 and time.monotonic() < deadline:
            time.sleep(0.5)
        out["trainer_added"] = ray.get(trainer.status.remote())["buffer"]["added"]
        deadline = time.monotonic() + 30  # replicas push their metrics every second
        while True:
            metrics = httpx.get("http://127.0.0.1:8000/metrics", headers={"Authorization": f"Bearer {key}"}).text
            lines = metrics.splitlines()
            traces = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("tandem:trace_buffer_added_total{"))
            replicas = sorted({line.split('replica="')[1].split('"')[0] for line in lines if 'replica="' in line})
            if (traces == out["trainer_added"] and len(replicas) == 2) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out["metrics_replicas"], out["metrics_traces_added"] = replicas, traces
        out["metrics_generation_tokens"] = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("tandem:generation_tokens_total{"))
        out["metrics_cluster_replicas"] = [line for line in lines if line.startswith("tandem:cluster_replicas ")]
        out["metrics_drafter_version_replicas"] = len([line for line in lines if line.startswith("tandem:drafter_version{replica=")])
        out["metrics_trace_losses"] = [line for line in lines if line.startswith(("tandem:trace_buffer_dropped_total{", "tandem:trace_collector_dropped_records_total{"))]
    finally:
        ray_serve.stop_app(deployed)
    return out


SCENARIOS = {"flywheel": flywheel, "rl": rl, "rl_resume": rl_resume, "serve": serve_scenario}


def main(scenarios: dict = SCENARIOS) -> int:
    from tandem.cluster.netns import in_private_netns

    if not in_private_netns():
        sys.exit("scenarios.py starts Ray: run it inside `python -m tandem.cluster.netns --ray-local -- ...` (loopback only)")
    model, work, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    names = sys.argv[4:] or list(scenarios)
    results: dict = {}
    began = time.monotonic()
    connect(num_cpus=2)
    results["ray_start_s"] = round(time.monotonic() - began, 2)
    try:
        for name in names:
            t0 = time.monotonic()
            try:
                results[name] = scenarios[name](model, work / name)
            except Exception:  # noqa: BLE001 - recorded for the test to report
                results[name] = {"traceback": traceback.format_exc()}
            results[name]["seconds"] = round(time.monotonic() - t0, 2)
            target.write_text(json.dumps(results, indent=1, default=str))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
