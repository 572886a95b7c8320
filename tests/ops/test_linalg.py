"""tandem.ops.linalg: the small solve against known answers."""
import pytest

from tandem.ops.linalg import solve


def test_solve_known_answer():
    a = [[4.0, 1.0, 0.0, 0.0], [1.0, 3.0, 1.0, 0.0], [0.0, 1.0, 2.0, 1.0], [0.0, 0.0, 1.0, 5.0]]
    x = [1.0, -2.0, 0.5, 3.0]
    b = [sum(a[i][j] * x[j] for j in range(4)) for i in range(4)]  # [2.0, -4.5, 1.0, 15.5]
    assert solve(a, b) == pytest.approx(x, abs=1e-12)


def test_solve_needs_the_pivot():
    assert solve([[0.0, 1.0], [2.0, 0.0]], [3.0, 4.0]) == pytest.approx([2.0, 3.0])
