"""When the flywheel trains harder: a shift detector on served acceptance, and the trainer's step schedule.

Traffic that moves to a domain the head drafts badly shows up as a drop in acceptance length. The detector
needs no domain tags: it compares the mean acceptance of the last `fast` requests with a baseline, the mean
of up to `slow` requests before them, and fires when the recent mean falls below (1 - drop) x baseline.
After firing it forgets both windows (the new traffic is the new normal: the next alarm needs `fast` +
`min_baseline` requests after this one) and stays quiet for at least `cooldown` requests. A rise in acceptance never fires: easier traffic needs no extra training.

The schedule turns the detector's alarms into work: `steps_per_request` trainer steps per served request
normally (what the trainer's own core affords; replay's old 0.5 was a budget choice), raised to
`boost_steps_per_request` right after a shift and decaying linearly back over `boost_requests`, with the
learning rate warmed up by `boost_lr` x in the same way (a warm restart of the schedule: the head has
something new to learn). Pure Python: the replay and the live loop both drive it per request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class ShiftDetectorConfig:
    # Per-request acceptance is noisy (sd ~0.3 at a mean of ~1.4 on this stream): a recent mean of 8 requests
    # fired 19 times on the general head's 3,000 static requests (9 shifts, 4 of them drops), 13 of them inside a
    # block; 16 requests against up to 64 fired 5 times, all within 31 requests of a shift (docs/BENCHMARKS.md 10).
    fast: int = 16  # requests in the recent mean
    slow: int = 64  # requests (at most) in the baseline before them
    min_baseline: int = 16  # the baseline needs this many requests before the detector may fire
    drop: float = 0.15  # fire when recent < (1 - drop) x baseline
    cooldown: int = 32  # requests after a shift before the next may fire

    def __post_init__(self) -> None:
        if self.fast < 1 or self.slow < 1 or not 1 <= self.min_baseline <= self.slow or self.cooldown < 0:
            raise InvalidParameterError("fast, slow >= 1, 1 <= min_baseline <= slow and cooldown >= 0 are required")
        if not 0.0 < self.drop < 1.0:
            raise InvalidParameterError(f"drop must be in (0, 1), got {self.drop}")


class ShiftDetector:
    def __init__(self, cfg: ShiftDetectorConfig = ShiftDetectorConfig()):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.fast)
        self.baseline: deque[float] = deque(maxlen=cfg.slow)
        self.seen = 0
        self.quiet_until = 0
        self.shifts: list[int] = []  # request indices (0-based) at which a shift was detected

    def observe(self, acceptance: float) -> bool:
        """Record one served request's acceptance length; True when a shift is detected at it."""
        if len(self.recent) == self.cfg.fast:
            self.baseline.append(self.recent[0])  # the value leaving the recent window joins the baseline
        self.recent.append(acceptance)
        self.seen += 1
        if self.seen <= self.quiet_until or len(self.recent) < self.cfg.fast or len(self.baseline) < self.cfg.min_baseline:
            return False
        base = sum(self.baseline) / len(self.baseline)
        if sum(self.recent) / len(self.recent) >= (1.0 - self.cfg.drop) * base:
            return False
        self.shifts.append(self.seen - 1)
        self.baseline.clear()  # the new traffic is the new normal: its own baseline builds up again,
        self.recent.clear()  # from requests after the shift only (old-domain values would drag it)
        self.quiet_until = self.seen + self.cfg.cooldown
        return True


@dataclass(frozen=True)
class StepScheduleConfig:
    steps_per_request: float = 1.0  # trainer steps per served request in steady state
    boost_steps_per_request: float = 4.0  # right after a detected shift
    boost_requests: int = 64  # the boost decays linearly to steady state over this many requests
    boost_lr: float = 2.0  # learning-rate multiplier right after a shift (decays with the boost)

    def __post_init__(self) -> None:
        if self.steps_per_request < 0 or self.boost_steps_per_request < self.steps_per_request or self.boost_requests < 1 or self.boost_lr < 1:
            raise InvalidParameterError("steps_per_request >= 0, boost_steps_per_request >= steps_per_request, boost_requests >= 1 and boost_lr >= 1 are required")


class StepSchedule:
    """Per request: how many trainer steps to take and the learning-rate multiplier; `shift()` restarts the boost."""

    def __init__(self, cfg: StepScheduleConfig = StepScheduleConfig()):
        self.cfg = cfg
        self.left = 0  # requests of boost left
        self.credit = 0.0
        self.boosts = 0

    def shift(self) -> None:
        self.left = self.cfg.boost_requests
        self.boosts += 1

    def _boost(self) -> float:
        """1.0 right after a shift, falling linearly to 0 over boost_requests."""
        return self.left / self.cfg.boost_requests

    def lr_scale(self) -> float:
        return 1.0 + (self.cfg.boost_lr - 1.0) * self._boost()

    def rate(self) -> float:
        return self.cfg.steps_per_request + (self.cfg.boost_steps_per_request - self.cfg.steps_per_request) * self._boost()

    def after_request(self) -> int:
        """Called once per served request: the whole trainer steps to take now (fractions carry over)."""
        self.credit += self.rate()
        steps = int(self.credit + 1e-9)  # 0.1 added ten times is 0.999...: count it as 1
        self.credit -= steps
        self.left = max(0, self.left - 1)
        return steps
