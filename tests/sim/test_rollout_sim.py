"""The rollout simulator against hand-computed drains: memory bound, compute bound, the controller's toggle."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.sim.rollout import choose_k, rollout_speedup, simulate_rollout
from tandem.sim.speculative import DraftCost


def memory_bound(batch, tokens, context):  # every forward costs the same: the weights' read
    return 1.0


def compute_bound(batch, tokens, context):  # cost grows with every token computed
    return float(batch * tokens)


def test_memory_bound_perfect_drafts_pay_their_acceptance_length():
    plain = simulate_rollout([3, 6], memory_bound, [1.0, 1.0], 2, "plain")
    fixed = simulate_rollout([3, 6], memory_bound, [1.0, 1.0], 2, "fixed")
    assert (plain.seconds, plain.steps, plain.batches) == (6.0, 6, [2, 2, 2, 1, 1, 1])
    assert (fixed.seconds, fixed.steps, fixed.batches, fixed.ks) == (2.0, 2, [2, 1], [2, 2])
    assert rollout_speedup([3, 6], memory_bound, [1.0, 1.0], 2, "fixed") == pytest.approx(3.0)


def test_compute_bound_speculation_pays_nothing_and_the_controller_turns_it_off():
    assert simulate_rollout([3, 6], compute_bound, [1.0, 1.0], 2, "plain").seconds == 9.0  # 3 steps of 2 rows, 3 of 1
    assert simulate_rollout([3, 6], compute_bound, [1.0, 1.0], 2, "fixed").seconds == 9.0  # 3 tokens for 3x the cost
    half = simulate_rollout([3, 6], compute_bound, [0.5, 0.5], 2, "fixed")  # 1.75 tokens per step for 3x the cost: slower
    assert half.seconds > 9.0
    ctl = simulate_rollout([3, 6], compute_bound, [0.5, 0.5], 2, "controller")
    assert ctl.ks == [0] * 6 and ctl.seconds == 9.0


def test_the_controller_speculates_only_in_the_tail():
    def ridge(batch, tokens, context):  # memory bound up to 4 rows' worth of tokens, compute bound above
        return max(1.0, batch * tokens / 4)

    assert choose_k(ridge, 8, 0, [0.9, 0.9], 2, DraftCost()) == 0  # 8 rows: a verify of 3 costs 6x a plain step
    assert choose_k(ridge, 1, 0, [0.9, 0.9], 2, DraftCost()) == 2  # 1 row: free until 4 tokens
    run = simulate_rollout([4] * 7 + [40], ridge, [0.9, 0.9], 2, "controller")
    assert run.ks[0] == 0 and run.ks[-1] == 2 and run.batches[-1] == 1


def test_bad_input():
    with pytest.raises(InvalidParameterError):
        simulate_rollout([], memory_bound, [1.0], 1)
    with pytest.raises(InvalidParameterError):
        simulate_rollout([3], memory_bound, [1.0], 1, "always")
