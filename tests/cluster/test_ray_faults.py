"""Faults under `tandem serve --ray --replicas 2 --online` and `tandem rl --ray`, typed as a user types them, on a
real local Ray cluster in a private network namespace (tests/cluster/fault_scenarios.py)."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray path needs ray[serve] (pip install 'tandem[ray]')")

from tandem.cluster.netns import netns_argv, netns_available, ray_local_env  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def observed(tiny_llama, tmp_path_factory):
    import subprocess

    reason = netns_available()
    if reason is not None:
        pytest.skip(f"no private network namespace here ({reason}): Ray tests never run on the host network")
    work = tmp_path_factory.mktemp("ray_faults")
    out = work / "observed.json"
    env = ray_local_env() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TANDEM_CPU_GEMM": "onednn"}
    argv = netns_argv([sys.executable, str(ROOT / "tests" / "cluster" / "fault_scenarios.py"), tiny_llama, str(work), str(out)])
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.is_file(), f"fault scenarios wrote nothing (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def _scenario(observed, name):
    result = observed.get(name)
    assert result is not None, f"scenario {name} did not run: {sorted(observed)}"
    assert "traceback" not in result, result["traceback"]
    assert "checker_traceback" not in result, result["checker_traceback"]
    return result


def test_serve_ray_online_starts_from_the_command_line_and_sizes_replicas_from_their_own_resources(observed):
    s = _scenario(observed, "serve_cli")
    assert s["up"] and s["rc"] == 0 and s["before_lossless"]
    assert len(s["app_names"]) == 1 and s["app_names"][0].startswith("tandem-")  # the deployment's own name, not "tandem"
    # --replica-cpus 0.5 on a 2-CPU node: 1 thread (the node's default would be 2), a KV budget of a quarter of its quarter of RAM
    kv = min(8 << 30, int(s["node_memory"] * 0.5 / 2) // 4)
    assert s["sizes"] == [[1, kv, 64], [1, kv, 64]]  # the batch: as many rows as the budget holds, at most 64


def test_serve_replaces_a_replica_whose_engine_loop_is_broken(observed):
    s = _scenario(observed, "serve_cli")
    assert s["broken_loop_alive"]  # the old health check (is the thread alive?) passed this replica
    assert s["broken_replaced"], s["broken_replaced_s"]
    assert s["after_broken_lossless"]  # every request answered (none 503), as plain greedy decoding


def test_a_replica_killed_under_serve_is_replaced_and_its_requests_end_whole_or_with_an_error(observed):
    s = _scenario(observed, "serve_cli")
    outcomes, whole = s["killed_outcomes"], {"status": 200, "tokens": 100}
    assert len(outcomes) == 6 and s["victim_held"] >= 1  # the killed replica held requests in flight
    for o in outcomes:  # none hung, none came back truncated as if complete: whole, or Serve's proxy's 500 (the openai client retries it)
        assert o in (whole, {"status": 500, "body": "Internal Server Error"}), o
    assert sum(o != whole for o in outcomes) <= s["victim_held"]  # only requests on the killed replica failed
    assert s["killed_replaced"], s["killed_replaced_s"]
    assert s["after_kill_lossless"]


def test_stopping_serve_ray_deletes_only_its_own_application_and_names_never_collide(observed):
    s = _scenario(observed, "serve_cli")
    assert s["apps_after"] == {"other": "ApplicationStatus.RUNNING"} and s["other_answers"] == "other"
    assert s["squatter_alive"]  # an actor named "tandem-trainer" (another deployment's, before) did not stop this one
    assert s["trainer_checkpoints"]  # the trainer checkpointed on the way down


def test_rl_on_ray_retries_a_step_whose_rollout_worker_died(observed):
    r = _scenario(observed, "rl_faults")
    w = r["worker_killed"]
    assert w["killed"] == "rollout worker 1" and w["rc"] == 0, w["stderr"]
    assert any(m.startswith("rollout worker 1 of 2 ") and "decoding its " in m for m in w["warnings"]), w["warnings"]
    # the same run as the uninterrupted one (test_ray_cluster.py): the retried slice kept its seeds and its policy
    assert [h["policy_version"] for h in w["history"]] == [1, 2] and [h["tokens"] for h in w["history"]] == [72, 72]
    assert [h["reward_mean"] for h in w["history"]] == pytest.approx([6 / 9, 6 / 9])  # parity reward over 9 rollouts a step (seeded draws)


def test_rl_on_ray_stops_clearly_when_the_learner_dies_and_resume_continues(observed):
    r = _scenario(observed, "rl_faults")
    dead, resumed, w = r["learner_killed"], r["resumed"], r["worker_killed"]
    assert dead["killed"] == "learner" and dead["rc"] == 1
    assert "error: the learner actor died while updating the policy at step 1 (ActorDiedError)" in dead["stderr"]
    assert "rerun with --resume DIR" in dead["stderr"] and [h["step"] for h in dead["history"]] == [0]
    assert resumed["rc"] == 0 and [h["step"] for h in resumed["history"]] == [0, 1]
    assert resumed["history"] == w["history"] and resumed["evals"] == w["evals"]
    assert r["policy_max_abs_diff"] == 0.0  # the resumed run ends on the same policy, bit for bit
