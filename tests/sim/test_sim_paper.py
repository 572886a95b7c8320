"""Amdahl, speculative throughput, and the RL-rollout paper's figures reproduced by the simulator."""
import pytest

from tandem.sim.amdahl import amdahl, overlapped
from tandem.sim.cluster import response_lengths
from tandem.sim.paper import PAPER_235B_END_TO_END, PAPER_235B_ROLLOUT_SPEEDUP, PAPER_8B_STEP_SPEEDUP, qwen3_8b_step_speedups, reproduce
from tandem.sim.speculative import DraftCost, best_chain, expected_tokens_tree, step_tokens_per_s


def test_amdahl_exact_values():
    assert amdahl(0.5, 2.0) == pytest.approx(4 / 3)
    assert amdahl(0.0, 9.0) == 1.0
    assert amdahl(1.0, 3.0) == pytest.approx(3.0)
    assert overlapped(6.0, 4.0, 3.0) == pytest.approx(6.0 / 4.0)  # training side becomes the bound


def test_qwen3_8b_step_speedup_within_005():
    figures = qwen3_8b_step_speedups()
    assert figures["step_at_1.8x_f=0.65"] == pytest.approx(PAPER_8B_STEP_SPEEDUP, abs=0.05)
    assert figures["step_at_f=0.65"] == pytest.approx(PAPER_8B_STEP_SPEEDUP, abs=0.05)


def test_235b_projection_within_15_percent():
    out = reproduce()["qwen3_235b_gb200"]
    assert out["rollout_speedup"] == pytest.approx(PAPER_235B_ROLLOUT_SPEEDUP, rel=0.15)
    assert out["async_step_speedup"] == pytest.approx(PAPER_235B_END_TO_END, rel=0.15)
    assert out["sync_step_speedup"] < out["rollout_speedup"]  # Amdahl: the rest of the step doesn't speed up


def test_tree_and_chain_throughput():
    forward = lambda b, t, c: 0.010 + 0.001 * b * t  # noqa: E731 (10 ms fixed + 1 ms per token)
    assert expected_tokens_tree([0.5, 0.5]) == pytest.approx(1.75)
    # chain of 2 at batch 1: 1.75 tokens / (10 + 3) ms vs plain 1 / 11 ms
    assert step_tokens_per_s(forward, 1, 0, [0.5, 0.5], [1, 1]) == pytest.approx(1.75 / 0.013)
    # a tree pays for every node: 2 + 2 nodes -> 5 tokens verified
    assert step_tokens_per_s(forward, 1, 0, [0.8, 0.6], [2, 2]) == pytest.approx((1 + 0.8 + 0.48) / 0.015)


def test_best_chain_turns_off_when_compute_bound():
    memory_bound = lambda b, t, c: 0.010 + 1e-5 * b * t  # noqa: E731
    compute_bound = lambda b, t, c: 0.001 * b * t  # noqa: E731
    assert best_chain(memory_bound, 1, 0, [0.8] * 4, 4)[0] == 4
    assert best_chain(compute_bound, 16, 0, [0.8] * 4, 4) == (0, 1.0)
    assert best_chain(memory_bound, 1, 0, [0.8] * 4, 4, DraftCost(per_depth_s=0.02))[0] == 0  # drafter too slow


def test_response_lengths_long_tail():
    lengths = response_lengths(32, 1000, 4000)
    assert lengths == sorted(lengths) and lengths[-1] == 4000 and lengths[-2] == 3060 and lengths[0] == 16  # capped tail
