"""Faults under the commands users type, on a real local Ray cluster (run by tests/cluster/test_ray_faults.py
inside a private network namespace; the runner is scenarios.main).

`serve_cli`: `tandem serve --ray --replicas 2 --online` beside another Serve application and an actor holding the
trainer's former fixed name; a replica whose engine loop breaks and a replica killed with requests in flight are
replaced by Serve; Ctrl-C deletes this deployment's application only. `rl_faults`: `tandem rl --ray` with a rollout
worker killed mid-run (the step is retried), with the learner killed mid-run (a clear error), then `--resume`.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import _policy_diff, main, rl_argv  # noqa: E402
from tiny_helpers import make_prompts, plain_outputs  # noqa: E402

from tandem.config import SamplingParams  # noqa: E402

KEY = "test-key-0123456789"
BASE = "http://127.0.0.1:8000"
GREEDY8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
REPLACE_S = 300  # a new replica imports torch and loads the model: seconds here, minutes on a crowded box


class _Idle:
    def ping(self) -> str:
        return "idle"


def _user_replica(actor):
    """Inside a Serve replica actor (through __ray_call__): the TandemReplica instance it hosts."""
    return actor._replica_impl._user_callable_wrapper._callable


def _replica_status(actor) -> dict:
    return _user_replica(actor).runtime.status()


def _break_loop(actor) -> bool:
    """Every iteration of this replica's engine loop now fails: after a few in a row the loop is broken (alive, 503s)."""
    runtime = _user_replica(actor).runtime

    def fault():
        raise RuntimeError("injected by the test: the engine's state is corrupt")

    runtime.engine.has_unfinished = fault
    return runtime.loop.alive


def _slow_steps(actor) -> None:
    _user_replica(actor).runtime.engine.between_steps.append(lambda engine: time.sleep(0.05))  # requests stay in flight for seconds


def _held(actor) -> int:
    return _user_replica(actor).runtime.loop.held


def _replicas() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::tandem")}


def _on(name: str, fn):
    import ray

    return ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(fn), timeout=60)


def _wait(predicate, timeout: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def _complete(prompt: list[int], max_tokens: int = 8) -> dict:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        r = httpx.post(f"{BASE}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    except Exception as e:  # noqa: BLE001 - recorded: the test says whether it is a clear error
        return {"exception": f"{type(e).__name__}: {e}"}
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text[:400]}
    return {"status": 200, "tokens": r.json()["usage"]["completion_tokens"], "text": r.json()["choices"][0]["text"]}


def _lossless(model: str, prompts: list[list[int]]) -> bool:
    from tandem.llm import load_tokenizer

    tokenizer = load_tokenizer(model)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in plain_outputs(model, prompts, [GREEDY8] * len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(_complete, prompts))
    return [a.get("text") for a in answers] == expected


def _replaced(victim: str, stop: threading.Event) -> tuple[bool, float]:
    began = time.monotonic()
    done = _wait(lambda: victim not in (now := _replicas()) and len(now) == 2 and _ready(now), REPLACE_S, stop)
    return done, round(time.monotonic() - began, 2)


def _ready(names: set[str]) -> bool:
    try:
        return all(_on(n, _replica_status)["loop_alive"] for n in names)
    except Exception:  # noqa: BLE001 - still starting
        return False


def _serve_checks(model: str, out: dict, stop: threading.Event) -> None:
    import httpx

    def up() -> bool:  # both replicas constructed (not only named) and the proxy routing
        names = _replicas()
        return len(names) == 2 and _ready(names) and httpx.get(f"{BASE}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200

    out["up"] = _wait(lambda: _safe(up), REPLACE_S, stop)
    if not out["up"]:
        return
    replicas = sorted(_replicas())
    out["app_names"] = sorted({n.split("::")[1].split("#")[0] for n in replicas})
    out["sizes"] = sorted([s["torch_threads"], s["kv_cache_bytes"], s["max_batch_size"]] for s in (_on(n, _replica_status) for n in replicas))
    out["node_memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out["before_lossless"] = _lossless(model, make_prompts(4, seed=41))
    broken = replicas[0]
    out["broken_loop_alive"] = _on(broken, _break_loop)
    out["broken_replaced"], out["broken_replaced_s"] = _replaced(broken, stop)
    out["after_broken_lossless"] = _lossless(model, make_prompts(8, seed=42))
    current = sorted(_replicas())
    for name in current:
        _on(name, _slow_steps)
    with ThreadPoolExecutor(6) as pool:
        inflight = [pool.submit(_complete, p, 100) for p in make_prompts(6, seed=43)]
        time.sleep(2.0)
        held = {name: _on(name, _held) for name in current}
        victim = max(current, key=held.get)  # the replica holding the most requests (Serve's router chose where they went)
        out["victim_held"] = held[victim]
        import ray

        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        out["killed_outcomes"] = [{k: v for k, v in f.result(timeout=180).items() if k != "text"} for f in inflight]
    out["killed_replaced"], out["killed_replaced_s"] = _replaced(victim, stop)
    out["after_kill_lossless"] = _lossless(model, make_prompts(4, seed=44))


def _safe(predicate) -> bool:
    try:
        return predicate()
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _checker(model: str, out: dict, stop: threading.Event) -> None:
    try:
        _serve_checks(model, out, stop)
    except Exception:  # noqa: BLE001 - recorded for the test
        out["checker_traceback"] = traceback.format_exc()
    finally:
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGTERM)  # what `kill`, systemd and Kubernetes send to stop `tandem serve --ray`


def _other_app() -> None:
    from ray import serve

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Other:
        def __call__(self, request) -> str:
            return "other"

    serve.run(Other.bind(), name="other", route_prefix="/other")


def serve_cli(model: str, work: Path) -> dict:
    import httpx
    import ray
    from ray import serve

    from tandem.cli import main as cli

    _other_app()  # another team's application on the same cluster (it starts Serve's proxy on 127.0.0.1:8000)
    squatter = ray.remote(_Idle).options(name="tandem-trainer", num_cpus=0).remote()  # the name every deployment's trainer used to take
    argv = ["serve", "--ray", "--replicas", "2", "--online", "--drafter", "eagle", "--draft-vocab-size", "200", "--model", model,
            "--served-model-name", "tiny", "--state-dir", str(work / "state"), "--replica-cpus", "0.5", "--trainer-cpus", "0.25",
            "--api-key", KEY, "--max-model-len", "128"]
    out: dict = {"command": " ".join(argv[:6])}
    stop = threading.Event()
    checker = threading.Thread(target=_checker, args=(model, out, stop), daemon=True)
    checker.start()
    try:
        out["rc"] = cli(argv)
    finally:
        stop.set()
        checker.join(timeout=60)
    out["apps_after"] = {name: str(app.status) for name, app in serve.status().applications.items()}
    out["other_answers"] = httpx.get(f"{BASE}/other").text
    out["squatter_alive"] = ray.get(squatter.ping.remote(), timeout=30) == "idle"
    out["trainer_checkpoints"] = sorted(p.name for p in (work / "state" / "checkpoint").glob("*"))
    ray.kill(squatter)
    serve.delete("other")
    return out


def _run_rl(argv: list[str], json_path: Path, kill=None) -> dict:
    """`tandem rl ...` in this process; `kill(ray, trainer, out)` runs as the command builds its trainer (it arms a fault
    for a later moment and records what it killed in out["killed"])."""
    import ray

    import tandem.cluster.rl as cluster_rl
    from tandem.cli import main as cli

    original = cluster_rl.build_ray_trainer
    out: dict = {}

    def build(*a, **k):
        trainer = original(*a, **k)
        if kill:
            kill(ray, trainer, out)
        return trainer

    cluster_rl.build_ray_trainer = build  # sees the actors the command starts
    warnings, handler = [], logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tandem.cluster").addHandler(handler)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            out["rc"] = cli(argv + ["--json", str(json_path)])
    finally:
        cluster_rl.build_ray_trainer = original
        logging.getLogger("tandem.cluster").removeHandler(handler)
    result = json.loads(json_path.read_text())
    out["history"] = [{k: h[k] for k in ("step", "policy_version", "reward_mean", "tokens", "rollout_tokens")} for h in result["history"]]
    out["evals"] = [{k: e[k] for k in ("step", "policy_version", "greedy", "sampled")} for e in result["evals"]]
    return out | {"stderr": err.getvalue()[-2000:], "warnings": warnings}


def _kill_worker(ray, trainer, out: dict) -> None:
    """Kill rollout worker 1 as a crash would (Ray restarts it) once the learner has handed over step 0's checkpoint,
    so that step 1's rollouts meet the restarted worker."""
    checkpoint = trainer.learner.checkpoint

    def checkpoint_then_crash():
        saved = checkpoint()
        if "killed" not in out:
            ray.kill(trainer.engines[0].workers[1], no_restart=False)
            out["killed"] = "rollout worker 1"
        return saved

    trainer.learner.checkpoint = checkpoint_then_crash


def _kill_learner(ray, trainer, out: dict) -> None:
    """Kill the learner actor as a crash would, just before the update of step 1 (the learner is never restarted)."""
    update = trainer.learner.update

    def update_after_a_crash(rollouts, advantages, step, online=None):
        if step == 1 and "killed" not in out:
            ray.kill(trainer.learner.actor, no_restart=False)
            out["killed"] = "learner"
        return update(rollouts, advantages, step, online)

    trainer.learner.update = update_after_a_crash


def rl_faults(model: str, work: Path) -> dict:
    _, on_ray = rl_argv(model)
    work.mkdir(parents=True, exist_ok=True)
    out = {"worker_killed": _run_rl(on_ray + ["--steps", "2", "--checkpoint", str(work / "w")], work / "w.json", _kill_worker),
           "learner_killed": _run_rl(on_ray + ["--steps", "2", "--checkpoint", str(work / "l")], work / "l.json", _kill_learner)}
    out["resumed"] = _run_rl(on_ray + ["--steps", "2", "--resume", str(work / "l"), "--checkpoint", str(work / "l")], work / "r.json")
    out["policy_max_abs_diff"] = _policy_diff(work / "w", work / "l")
    return out


FAULTS = {"serve_cli": serve_cli, "rl_faults": rl_faults}

if __name__ == "__main__":
    sys.exit(main(FAULTS))
