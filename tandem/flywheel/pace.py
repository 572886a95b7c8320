"""How much the trainer steps: what its core affords, and only while a step still buys something.

`CoreBudget` derives the replay trainer's step rate from the core it has instead of a fixed number of steps per
request: each served request earns the trainer `cores` x its serving seconds of compute, each step spends its
measured seconds, and the trainer steps while it has credit left (a trainer on a core of its own, stepping
back to back next to one decode stream, does the same). Idle time is not banked: a core that had nothing to
train on cannot spend those seconds later.

`LossPacer` stops stepping when the newest traces are already learnt: the trainer probes the loss on its newest
traces (a forward pass, no backward), takes a round of steps, and probes the same traces again; when the round
lowered that loss by less than `margin`, more steps buy little, and the trainer rests until `fresh` new traces
have arrived (new traffic: a new round tells whether they teach anything). Both are pure Python: the caller
passes the seconds and losses it measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidParameterError


class CoreBudget:
    def __init__(self, cores: float = 1.0):
        if cores <= 0:
            raise InvalidParameterError(f"cores must be > 0, got {cores}")
        self.cores = cores
        self.credit = 0.0  # trainer seconds earned and not yet spent (negative: the last step overran its credit)
        self.spent = 0.0
        self.steps = 0

    def earn(self, serve_s: float) -> None:
        """A request was served in `serve_s` seconds: the trainer's core had as long (times `cores`)."""
        self.credit += self.cores * serve_s

    def affords(self) -> bool:
        return self.credit > 0

    def spend(self, step_s: float) -> None:
        self.credit -= step_s
        self.spent += step_s
        self.steps += 1

    def idle(self) -> None:
        """Nothing to train on: the credit earned so far is gone (an overrun is still owed)."""
        self.credit = min(self.credit, 0.0)


@dataclass(frozen=True)
class PaceConfig:
    margin: float = 0.01  # a round of steps that lowers its probe batch's loss by less than this share buys too little: rest
    steps_per_round: int = 10  # trainer steps between the two probes of a round
    fresh: int = 4  # resting, start a new round once this many new traces arrived

    def __post_init__(self) -> None:
        if self.margin < 0 or self.steps_per_round < 1 or self.fresh < 1:
            raise InvalidParameterError("margin >= 0, steps_per_round >= 1 and fresh >= 1 are required")


class LossPacer:
    """Rounds of `steps_per_round` steps, each between two probes of the loss on the same newest traces (taken when
    the round starts): a round whose steps lowered that loss by less than `margin` (relative) ends in a rest until
    `fresh` new traces arrived. States: "start" (probe the newest traces next), "stepping", "end" (probe the same
    traces again), "resting"."""

    def __init__(self, cfg: PaceConfig = PaceConfig()):
        self.cfg = cfg
        self.state = "start"
        self.rounds = 0  # rounds finished
        self.rests = 0  # of which ended in a rest
        self._before = 0.0  # the round's first probe
        self._steps = 0
        self._traces_at_rest = 0

    def wants_probe(self, traces_added: int) -> bool:
        """Whether to probe before the next step (`traces_added`: the buffer's count of traces so far)."""
        if self.state == "resting" and traces_added - self._traces_at_rest >= self.cfg.fresh:
            self.state = "start"
        return self.state in ("start", "end")

    def probe(self, loss: float, traces_added: int) -> None:
        """The loss on the round's traces: at its start (the newest now), or at its end (the same ones again)."""
        if self.state == "start":
            self.state, self._before, self._steps = "stepping", loss, 0
            return
        gain = (self._before - loss) / self._before if self._before > 0 else 0.0
        self.rounds += 1
        if gain < self.cfg.margin:
            self.state, self._traces_at_rest = "resting", traces_added
            self.rests += 1
        else:
            self.state = "start"

    def may_step(self) -> bool:
        return self.state == "stepping"

    def stepped(self) -> None:
        """A step was taken (counted in a round only: a step taken without a verdict belongs to none)."""
        if self.state != "stepping":
            return
        self._steps += 1
        if self._steps >= self.cfg.steps_per_round:
            self.state = "end"
