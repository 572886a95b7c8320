"""tandem.ops.checks: finiteness read once, for every float width."""
import pytest
import torch

from tandem.ops.checks import all_finite


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_finds_one_bad_value_and_passes_the_largest_finite_ones(value, dtype):
    big = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)  # float32 and narrower: their sum overflows float32, not float64; float64 takes the mask
    assert all_finite(big) and all_finite(-big)
    big[1234] = value
    assert not all_finite(big)
    mixed = torch.tensor([float("inf"), -float("inf")], dtype=dtype)  # inf + -inf: NaN, still caught
    assert not all_finite(mixed)
