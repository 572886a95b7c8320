"""The rollout simulator against a measured run: hand-made runs with hand-computed predictions."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.sim.rollout_compare import constant_acceptance, predicted_vs_measured
from tandem.sim.speculative import DraftCost


def test_constant_acceptance_inverts_the_chain_formula():
    assert constant_acceptance(1.75, 2) == [0.5, 0.5]  # 1 + 0.5 + 0.25
    assert constant_acceptance(1.0, 3) == [0.0] * 3
    assert constant_acceptance(9.0, 2) == [1.0, 1.0]  # clamped to k + 1
    with pytest.raises(InvalidParameterError):
        constant_acceptance(2.0, 0)


def run(names=("ar", "x", "x@fixed")):
    seconds = {"ar": 8.0, "x": 4.0, "x@fixed": 2.0}
    return {"history": [{
        "rollout_s": {n: seconds[n] for n in names}, "rollout_tokens": {n: 8 for n in names},
        "acceptance_length": {"ar": 1.0, "x": 1.5, "x@fixed": 3.0}, "completion_lengths": {n: [4, 4] for n in names},
        "prompt_tokens_mean": 0.0, "profiles": {"ar": [[2, 2.0, 0.0]] * 4},
    }]}


def test_predicted_vs_measured_on_a_memory_bound_machine():
    """One second per forward whatever its size, free drafts: plain takes 4 steps of two sequences of 4 tokens; a
    chain of 2 drafts that are always accepted (acceptance length 3 = k + 1) emits 3 a step: 2 steps, 2.0x."""
    result = predicted_vs_measured(run(), lambda b, t, c: 1.0, {"x": DraftCost()}, max_k=2)
    assert (result["plain_predicted_s"], result["plain_measured_s"], result["cost_model_error"]) == (4.0, 8.0, -0.5)
    rows = {r["engine"]: r for r in result["engines"]}
    assert rows["x@fixed"] | {} == {"engine": "x@fixed", "policy": "fixed", "acceptance_from": "x@fixed", "acceptance_per_position": 1.0,
                                    "measured_speedup": 4.0, "predicted_speedup": 2.0, "error": -0.5}
    assert rows["x"]["acceptance_from"] == "x@fixed" and rows["x"]["policy"] == "controller"  # quality from the twin, not its own 1.5
    assert rows["x"]["predicted_speedup"] == 2.0 and rows["x"]["measured_speedup"] == 2.0
    assert result["per_batch"] == {2: {"steps": 4, "measured_ms": 2000.0, "predicted_ms": 1000.0}}


def test_the_controller_keeps_plain_where_a_verify_costs_what_it_returns():
    """Cost proportional to the tokens of the forward (compute-bound): a 3-token verify that emits 3 tokens
    gains nothing, a draft that costs anything loses: the controller stays plain (1.0x), always-k loses."""
    result = predicted_vs_measured(run(), lambda b, t, c: 0.1 * b * t, {"x": DraftCost(per_depth_s=0.05)}, max_k=2)
    rows = {r["engine"]: r for r in result["engines"]}
    assert rows["x"]["predicted_speedup"] == 1.0
    assert rows["x@fixed"]["predicted_speedup"] == pytest.approx(0.8 / (2 * (0.6 + 0.1)), abs=1e-3)  # 2 steps of 0.6 + 2 x 0.05


def test_a_run_without_lengths_is_refused_with_a_clear_error():
    old = run()
    del old["history"][0]["completion_lengths"]
    with pytest.raises(InvalidParameterError, match="completion lengths"):
        predicted_vs_measured(old, lambda b, t, c: 1.0, {}, max_k=2)
