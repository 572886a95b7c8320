"""The controller's cost models (tandem.engine.costs): the drafter's online least squares in plain Python."""
import numpy as np
import pytest

from tandem.engine.costs import FORGET, RIDGE, DraftCostModel
from tandem.sim.speculative import DraftCost


def test_draft_cost_one_observation_by_hand():
    """From a zero prior, one step of depth 2, 3 nodes, 1 sequence taking 0.01 s, x = [1, 2, 3, 1]: the normal equations
    are (RIDGE I + x x^T) coef = s x, whose solution (Sherman-Morrison) is coef = s x / (x.x + RIDGE)."""
    model = DraftCostModel()
    model.observe(2, 3, 1, 0.01)
    x = [1.0, 2.0, 3.0, 1.0]
    ridge = FORGET * RIDGE + (1 - FORGET) * RIDGE  # the forgotten prior's diagonal, topped up: RIDGE again
    expected = [0.01 * xi / (sum(v * v for v in x) + ridge) for xi in x]
    assert [model.current.fixed_s, model.current.per_depth_s, model.current.per_node_s, model.current.per_sequence_s] == pytest.approx(expected, rel=1e-9)
    assert model.seconds(2, 3, 1) == pytest.approx(0.01 * 15 / 16)


def test_draft_cost_matches_the_forgetting_ridge_normal_equations():
    """The loop form equals the matrix form: A <- F A + x x^T + (1 - F) R I, b <- F b + s x + (1 - F) R prior,
    coef = max(A^-1 b, 0), here in numpy over a fixed sequence of steps."""
    prior = DraftCost(fixed_s=0.002, per_depth_s=0.001)
    model = DraftCostModel(prior)
    a, b, p = RIDGE * np.eye(4), RIDGE * np.array([0.002, 0.001, 0.0, 0.0]), np.array([0.002, 0.001, 0.0, 0.0])
    for i in range(60):
        depth, nodes, sequences = 1 + i % 4, 1 + i % 4 + i % 3, 1 + i % 2
        seconds = 0.001 + 0.0005 * depth + 0.0004 * nodes + 0.0002 * sequences
        model.observe(depth, nodes, sequences, seconds)
        x = np.array([1.0, depth, nodes, sequences])
        a = FORGET * a + np.outer(x, x) + (1 - FORGET) * RIDGE * np.eye(4)
        b = FORGET * b + seconds * x + (1 - FORGET) * RIDGE * p
    expected = np.clip(np.linalg.solve(a, b), 0.0, None)
    got = [model.current.fixed_s, model.current.per_depth_s, model.current.per_node_s, model.current.per_sequence_s]
    assert got == pytest.approx(expected.tolist(), rel=1e-9, abs=1e-15)
    assert model.seconds(4, 6, 2) == pytest.approx(float(expected @ [1.0, 4.0, 6.0, 2.0]), rel=1e-9)


def test_draft_cost_ignores_steps_that_did_not_draft():
    model = DraftCostModel(DraftCost(per_depth_s=0.003))
    model.observe(0, 0, 1, 5.0)
    assert model.current == DraftCost(per_depth_s=0.003)
