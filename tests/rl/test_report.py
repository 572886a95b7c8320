"""The speedup summary on a synthetic history with known numbers."""
import pytest

from tandem.rl.report import summarize


def step(i):
    return {"step": i, "rollout_s": {"ar": 6.0, "self_draft": 3.0}, "train_s": 3.5, "step_wall_s": 10.0,
            "sync": {"target": 0.5, "resync/ar": 0.0, "resync/self_draft": 0.25}, "acceptance_length": {"ar": 1.0, "self_draft": 2.5}}


def test_summary_speedups_and_amdahl():
    s = summarize([step(0), step(1)])
    assert s["generation_share"] == pytest.approx(0.6)  # 6 / (6 + 3.5 + 0.5)
    d = s["per_drafter"]["self_draft"]
    assert d["rollout_speedup"] == pytest.approx(2.0)
    assert d["amdahl_prediction"] == pytest.approx(1 / (0.6 / 2 + 0.4), abs=1e-3)  # 1.4286
    assert d["step_speedup"] == pytest.approx(20 / 14.5, abs=1e-3)  # (6+4) / (3+4+0.25) per step
    assert d["resync_share_of_step"] == pytest.approx(0.5 / 14.5, abs=1e-4)
    assert s["per_drafter"]["ar"]["step_speedup"] == 1.0


def test_token_rate_speedup_when_rollout_lengths_differ():
    history = [step(0) | {"rollout_tokens": {"ar": 100, "self_draft": 80}}]
    d = summarize(history)["per_drafter"]["self_draft"]
    assert d["rollout_speedup"] == pytest.approx(2.0)  # wall times: 6 s vs 3 s
    assert d["rollout_tokens_per_s"] == pytest.approx(80 / 3, abs=0.01)
    assert d["rollout_rate_speedup"] == pytest.approx((80 / 3) / (100 / 6), abs=1e-3)  # 1.6: less work was done
    assert "rollout_rate_speedup" not in summarize([step(0)])["per_drafter"]["self_draft"]


def test_tail_profile_buckets_the_controllers_decisions():
    from tandem.rl.report import tail_profile

    history = [{"decisions": {"spec": {1: {"steps": 4, "mean_k": 3.0, "spec_share": 1.0, "seconds": 1.0},
                                       8: {"steps": 2, "mean_k": 0.5, "spec_share": 0.25, "seconds": 3.0}}}},
               {"decisions": {"spec": {"20": {"steps": 1, "mean_k": 0.0, "spec_share": 0.0, "seconds": 4.0}}}}]
    rows = tail_profile(history)["spec"]
    assert rows["1"] == {"steps": 4, "seconds": 1.0, "mean_k": 3.0, "spec_share": 1.0, "time_share": 0.125}
    assert rows["2-4"]["steps"] == 0 and rows["2-4"]["time_share"] == 0.0
    assert rows["5-15"] == {"steps": 2, "seconds": 3.0, "mean_k": 0.5, "spec_share": 0.25, "time_share": 0.375}
    assert rows[">=16"] == {"steps": 1, "seconds": 4.0, "mean_k": 0.0, "spec_share": 0.0, "time_share": 0.5}


def test_the_learning_panel_names_reward_and_exact_accuracy():
    from tandem.rl.report import learning_curves
    from tandem.rl.rewards import reward_label

    evals = [{"step": 0, "greedy": 0.25, "greedy_exact": 0.125, "sampled": 0.5, "sampled_exact": 0.375},
             {"step": 5, "greedy": 0.5, "greedy_exact": 0.25, "sampled": 0.75, "sampled_exact": 0.625}]
    assert learning_curves(evals, reward_label("reasoning_gym")) == [
        ("reward (reasoning-gym score, partial credit), greedy", [0, 5], [0.25, 0.5]), ("exact accuracy, greedy", [0, 5], [0.125, 0.25]),
        ("reward (reasoning-gym score, partial credit), sampled", [0, 5], [0.5, 0.75]), ("exact accuracy, sampled", [0, 5], [0.375, 0.625])]
    assert [c[0] for c in learning_curves([{"step": 0, "greedy": 0.1, "sampled": 0.2}], "reward (my.mod:f)")] == [
        "reward (my.mod:f), greedy", "reward (my.mod:f), sampled"]  # evals recorded before exact accuracy
