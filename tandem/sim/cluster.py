"""Cluster-scale RL step simulator: a rollout with a shrinking batch, with and without speculation, then
the RL step around it (synchronous: generation then training; asynchronous: the two overlap).

A rollout replica decodes its share of the step's sequences; sequences finish at different lengths,
so the batch shrinks over the rollout and its tail is small and memory-bound (where speculation pays
most). Each decode step costs one roofline forward (tandem.sim.roofline) of the live batch at its mean
context; with speculation, each step also pays the drafter and emits E(k) tokens per sequence (a fluid
approximation of acceptance), where k is the best chain length for that step's batch (0 = plain): the
controller's decision, made with perfect knowledge of the cost model. All replicas are alike, so the
rollout time of one replica is the rollout time of the cluster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.errors import InvalidParameterError
from tandem.sim.amdahl import amdahl, overlapped
from tandem.sim.roofline import Machine, ModelWork, forward_seconds
from tandem.sim.speculative import DraftCost, best_chain
from tandem.ops.cost import expected_tokens_per_step


@dataclass(frozen=True)
class RolloutScenario:
    work: ModelWork
    machine: Machine  # one rollout replica (see tandem.sim.parallel.replica_machine)
    devices: int  # devices in the cluster
    devices_per_replica: int
    sequences: int  # sequences per RL step (prompts x samples per prompt)
    prompt_tokens: int
    mean_response_tokens: int
    max_response_tokens: int
    acceptance: tuple[float, ...]  # conditional acceptance per draft position
    max_k: int
    draft: DraftCost = DraftCost()
    generation_share: float = 0.7  # f: generation / step time of the synchronous plain baseline
    steps_per_bucket: int = 16  # decode steps simulated at one batch size before re-planning (speed)

    def __post_init__(self) -> None:
        if self.devices % self.devices_per_replica:
            raise InvalidParameterError("devices must be a multiple of devices_per_replica")
        if not 0 < self.generation_share < 1:
            raise InvalidParameterError("generation_share must be in (0, 1)")
        if self.max_k > len(self.acceptance):
            raise InvalidParameterError("max_k exceeds the acceptance profile")

    @property
    def replicas(self) -> int:
        return self.devices // self.devices_per_replica

    @property
    def sequences_per_replica(self) -> int:
        return math.ceil(self.sequences / self.replicas)


def response_lengths(n: int, mean: int, maximum: int) -> list[int]:
    """Deterministic long-tailed lengths: exponential quantiles with this mean, capped at `maximum`."""
    return [max(1, min(maximum, round(-mean * math.log(1 - (i + 0.5) / n)))) for i in range(n)]


def rollout_seconds(s: RolloutScenario, speculate: bool) -> tuple[float, int]:
    """(seconds, target forwards) for one replica to finish all its sequences."""
    remaining = sorted(float(x) for x in response_lengths(s.sequences_per_replica, s.mean_response_tokens, s.max_response_tokens))
    generated, seconds, forwards = 0.0, 0.0, 0
    forward = lambda b, t, c: forward_seconds(s.work, s.machine, b, t, c)  # noqa: E731
    while remaining:
        batch, context = len(remaining), s.prompt_tokens + int(generated)
        k = best_chain(forward, batch, context, list(s.acceptance), s.max_k, s.draft)[0] if speculate else 0
        per_step = expected_tokens_per_step(list(s.acceptance), k)
        step_s = s.draft.seconds(k, batch * k, batch) + forward(batch, 1 + k, context)
        steps = max(1, min(s.steps_per_bucket, math.ceil(remaining[0] / per_step)))
        seconds += steps * step_s
        forwards += steps
        generated += steps * per_step
        remaining = [r - steps * per_step for r in remaining if r - steps * per_step > 1e-9]
    return seconds, forwards


@dataclass(frozen=True)
class StepPrediction:
    rollout_plain_s: float
    rollout_spec_s: float
    rollout_speedup: float
    sync_step_speedup: float  # Amdahl at generation_share
    async_step_speedup: float  # async plain -> async with speculation
    async_vs_sync_plain: float  # async with speculation vs the synchronous plain baseline


def simulate_step(s: RolloutScenario) -> StepPrediction:
    plain, _ = rollout_seconds(s, speculate=False)
    spec, _ = rollout_seconds(s, speculate=True)
    speedup = plain / spec
    rest = plain * (1 - s.generation_share) / s.generation_share  # log-prob recompute + training + sync
    return StepPrediction(
        rollout_plain_s=plain, rollout_spec_s=spec, rollout_speedup=speedup,
        sync_step_speedup=amdahl(s.generation_share, speedup),
        async_step_speedup=overlapped(plain, rest, speedup),
        async_vs_sync_plain=(plain + rest) / max(spec, rest),
    )
