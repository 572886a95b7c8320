"""Amdahl's law for an RL step whose generation phase alone is sped up (pure math)."""
from __future__ import annotations

from tandem.errors import InvalidParameterError


def amdahl(fraction: float, speedup: float) -> float:
    """Whole-step speedup when `fraction` of the time runs `speedup` times faster: 1 / (f / s + (1 - f))."""
    if not 0.0 <= fraction <= 1.0 or speedup <= 0:
        raise InvalidParameterError(f"need 0 <= fraction <= 1 and speedup > 0, got {fraction}, {speedup}")
    return 1.0 / (fraction / speedup + (1.0 - fraction))


def overlapped(generation_s: float, rest_s: float, generation_speedup: float, exposed_s: float = 0.0) -> float:
    """Async RL (generation of step i+1 overlaps training on step i): step time = max(gen, rest) + exposed.

    Returns the step speedup from speeding generation up, both sides asynchronous."""
    if generation_s < 0 or rest_s < 0 or generation_speedup <= 0 or exposed_s < 0:
        raise InvalidParameterError("times must be >= 0 and the speedup > 0")
    before = max(generation_s, rest_s) + exposed_s
    after = max(generation_s / generation_speedup, rest_s) + exposed_s
    return before / after
