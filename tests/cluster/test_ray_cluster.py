"""tandem on a real local Ray cluster (tests/cluster/scenarios.py, run inside a private network namespace).

One Ray session serves every scenario (Ray's start-up is most of the cost): a 2-replica + trainer flywheel
with a swap reaching both replicas, a killed replica and a killed trainer; one GRPO step on 2 rollout workers
and a learner actor against the embedded engine; `tandem rl --ray --checkpoint` resumed against an uninterrupted run; `tandem serve --ray` (Ray Serve, 2 replicas) answering the openai client.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray path needs ray[serve] (pip install 'tandem[ray]')")

from tandem.cluster.netns import netns_argv, netns_available, ray_local_env  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def observed(tiny_llama, tmp_path_factory):
    reason = netns_available()
    if reason is not None:
        pytest.skip(f"no private network namespace here ({reason}): Ray tests never run on the host network")
    work = tmp_path_factory.mktemp("ray")
    out = work / "observed.json"
    # TANDEM_CPU_GEMM=onednn: these tests are about placement, faults and the wire, not kernels; every actor process
    # would otherwise load (or wait for a build of) the C++ GEMM extension. References are computed in the same env.
    env = ray_local_env() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TANDEM_CPU_GEMM": "onednn"}
    argv = netns_argv([sys.executable, str(ROOT / "tests" / "cluster" / "scenarios.py"), tiny_llama, str(work), str(out)])
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.is_file(), f"scenarios wrote nothing (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def _scenario(observed, name):
    result = observed.get(name)
    assert result is not None, f"scenario {name} did not run: {sorted(observed)}"
    assert "traceback" not in result, result["traceback"]
    return result


def test_two_replicas_and_a_trainer_swap_reaches_both_lossless(observed):
    f = _scenario(observed, "flywheel")
    assert f["initial_versions"] == [0, 0]
    assert f["first_replicas"] == [0, 1]  # round-robin reached both
    assert f["first_lossless"] and f["after_swap_lossless"]  # greedy outputs equal plain decoding, before and after swaps
    assert f["swapped_both"], f["versions_after_swap"]
    assert all(v > 0 for v in f["versions_after_swap"]) and all(s >= 1 for s in f["swaps"]) and f["refused"] == [0, 0]
    assert f["trainer"]["error"] is None and f["trainer"]["published"] >= max(f["versions_after_swap"])


def test_a_killed_replica_fails_its_requests_clearly_restarts_and_the_other_serves(observed):
    f = _scenario(observed, "flywheel")
    outcomes = f["killed_replica_outcomes"]
    assert len(outcomes) == 6 and any("error" in o for o in outcomes)
    for o in outcomes:  # each either finished whole or failed with the clear error: none hung, none truncated silently
        assert o == {"ok": 100} or (o["error"].startswith("replica 0 ") and "the request did not finish, retry on any replica" in o["error"]), o
    assert f["killed_replica_resolved_s"] < 60
    assert f["other_replica_lossless"]
    assert f["replica_restarted"] and f["restarted_caught_up"]  # the new replica process adopted the newest version


def test_a_killed_trainer_resumes_from_its_checkpoint_while_replicas_keep_serving(observed):
    f = _scenario(observed, "flywheel")
    assert f["served_while_trainer_dead"]
    held, during = f["versions_held"], f["versions_during"]
    assert all(d >= h for d, h in zip(during, held))  # never back to an older version, never a half-applied one (lossless above)
    assert all(d < f["first_published_after_restart"] for d in during)  # only versions the dead trainer had published
    assert f["trainer_restarted"]
    assert f["checkpoint_step"] <= f["resumed_from_step"] <= f["steps_before_kill"]
    assert f["adopted_after_restart"] and min(f["versions_final"]) >= f["first_published_after_restart"]


def test_no_trace_is_lost_without_a_count(observed):
    f = _scenario(observed, "flywheel")
    for counts in f["trace_counts"]:  # each replica's traces, all accounted for once their sends resolved
        assert counts["pending"] == 0 and counts["dropped"] == 0
        assert counts["lost"] >= 1  # sent while the trainer was dead: counted, not silently gone
        assert counts["sent"] == counts["acked"] + counts["refused"] + counts["lost"]
    # what the killed trainer held and had not spilled is counted by its successor (an upper bound)
    assert f["lost_with_buffer"] >= f["held_before_kill"] - f["spilled_before_kill"] > 0


def test_one_rl_step_on_two_rollout_workers_equals_the_embedded_engine(observed):
    r = _scenario(observed, "rl")
    embedded, ray = r["embedded"], r["ray"]
    assert len(embedded["rollouts"]) == 9
    for when in ("rollouts", "after"):  # before, and after one update broadcast through the object store
        assert [_exact(r) for r in ray[when]] == [_exact(r) for r in embedded[when]]  # prompts, seeds, tokens, policy version
        for a, b in zip(ray[when], embedded[when]):  # a worker's batch is a slice of the embedded one: float noise only
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-3)
    assert ray["policy_version"] == embedded["policy_version"] == embedded["after"][0]["policy_version"] > embedded["rollouts"][0]["policy_version"]
    assert (ray["learner"], embedded["learner"]) == ("RemoteLearner", "Learner") and ray["learner_version"] == embedded["learner_version"] == 1
    assert ray["learner_pid"] != ray["driver_pid"]  # the update ran in the learner actor's process, not here


def test_rl_on_ray_resumed_from_its_checkpoint_equals_the_uninterrupted_run_and_the_embedded_one(observed):
    r = _scenario(observed, "rl_resume")
    whole, first, resumed, embedded = r["whole"], r["first"], r["resumed"], r["embedded"]
    assert [run["rc"] for run in (whole, first, resumed, embedded)] == [0, 0, 0, 0]
    assert (whole["ray"], resumed["ray"], embedded["ray"]) == (True, True, False)
    assert [h["step"] for h in first["history"]] == [0] and [h["step"] for h in resumed["history"]] == [0, 1]  # --steps is the total
    assert resumed["history"][0]["step_wall_s"] == first["history"][0]["step_wall_s"]  # step 0 restored from the checkpoint, not re-run
    assert resumed["history"][0]["step_wall_s"] != whole["history"][0]["step_wall_s"]
    timeless = [[{k: v for k, v in h.items() if k != "step_wall_s"} for h in run["history"]] for run in (whole, resumed, embedded)]
    assert timeless[0] == timeless[1] == timeless[2]
    assert [h["policy_version"] for h in whole["history"]] == [1, 2] and [h["tokens"] for h in whole["history"]] == [72, 72]
    assert [h["reward_mean"] for h in whole["history"]] == pytest.approx([6 / 9, 6 / 9])  # parity reward over 9 rollouts a step (seeded draws)
    assert whole["evals"] == resumed["evals"] == embedded["evals"] and [e["step"] for e in whole["evals"]] == [0, 1, 2]
    assert r["checkpoint_step"] == {"whole": 2, "split": 2, "embedded": 2}
    assert r["policy_max_abs_diff"]["resumed"] == 0.0  # the same workers' rollouts, the learner restored bit for bit
    assert r["policy_max_abs_diff"]["embedded"] < 1e-4  # a worker's batch is a slice of the embedded one: float noise only


def _exact(rollout: dict) -> dict:
    return {k: v for k, v in rollout.items() if k != "logprobs"}


def test_serve_on_ray_answers_the_openai_client_with_every_replica_in_metrics(observed):
    s = _scenario(observed, "serve")
    assert s["texts"] == s["expected"]
    assert s["streamed"] == s["expected"][0]
    assert s["bad_key"]["status"] == 401 and s["bad_key"]["body"]["error"]["code"] == "invalid_api_key"
    assert s["unknown_model"]["status"] == 404 and s["unknown_model"]["body"]["code"] == "model_not_found"
    assert len(s["metrics_replicas"]) == 2
    assert s["metrics_cluster_replicas"] == ["tandem:cluster_replicas 2.0"] or s["metrics_cluster_replicas"] == ["tandem:cluster_replicas 2"]
    assert s["metrics_generation_tokens"] == 9 * 8  # 8 concurrent requests + 1 streamed, 8 tokens each, over both replicas
    assert s["metrics_drafter_version_replicas"] == 2  # --online: each replica reports the version it serves
    assert s["trainer_added"] == 9, s["metrics_trace_losses"]  # every request's trace reached the trainer actor
    assert s["metrics_traces_added"] == 9  # and each replica's /metrics counts the ones it delivered
