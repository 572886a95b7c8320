"""Speculative rollouts for RL: many samples per prompt, with the log-probs the learner needs.

`RolloutEngine.generate_rollouts(prompts, n_per_prompt, params)` decodes every prompt n times (one
request each, own seed) through the engine, with or without a drafter (same API), and returns per
sample the prompt and completion ids, the log-prob of each sampled token under the distribution it
was drawn from and under the untempered policy (recorded by the engine from the verify forward, so
speculation does not change them), the finish reason, spec metrics and the policy version.

`update_policy(engines, named_tensors, version)` is the per-step policy sync: the target's weights are
copied in place once (validated by `Engine.update_target`), every engine sharing that target resets its
KV state, and each drafter re-syncs (`self_draft` re-quantizes; a learned head is trained by the learner,
see tandem.rl.eagle_online; stateless drafters have nothing to do).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError

SEED_STRIDE = 1_000_003  # sample seeds of one call: params.seed + SEED_STRIDE * prompt + sample


@dataclass
class Rollout:
    prompt_index: int  # which prompt (the GRPO group)
    sample_index: int  # which of its n samples
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # [len(completion)] under the distribution sampled from (temperature/top-k/top-p)
    policy_logprobs: list[float]  # [len(completion)] under the untempered policy
    finish_reason: str
    metrics: dict  # per-sample spec metrics (RequestMetrics.as_dict)
    policy_version: int  # version of the weights that produced it
    seed: int | None


@dataclass
class StepProfile:
    """One engine step during a rollout: how many sequences decoded and what the controller chose."""

    batch: int  # requests decoded in this step (the live batch)
    seconds: float
    ks: list[int] = field(default_factory=list)  # draft length chosen per decoded request (0 = plain)


@dataclass
class RolloutBatch:
    drafter: str
    rollouts: list[Rollout]
    wall_s: float
    profile: list[StepProfile]

    def acceptance_length(self) -> float:
        steps = sum(r.metrics["steps"] for r in self.rollouts)
        tokens = sum(max(0, r.metrics["output_tokens"] - 1) for r in self.rollouts)
        return tokens / steps if steps else 0.0

    def decisions(self) -> dict[int, dict]:
        """Per live batch size: steps, mean draft length, share of requests speculating."""
        out: dict[int, dict] = {}
        for p in self.profile:
            if not p.ks:
                continue
            d = out.setdefault(p.batch, {"steps": 0, "k_sum": 0, "on": 0, "n": 0, "seconds": 0.0})
            d["steps"] += 1
            d["k_sum"] += sum(p.ks)
            d["on"] += sum(k > 0 for k in p.ks)
            d["n"] += len(p.ks)
            d["seconds"] += p.seconds
        return {b: {"steps": d["steps"], "mean_k": round(d["k_sum"] / d["n"], 3), "spec_share": round(d["on"] / d["n"], 3),
                    "seconds": round(d["seconds"], 4)} for b, d in sorted(out.items())}


class RolloutEngine:
    """An Engine plus its drafter (None = plain decoding) used for RL rollouts."""

    def __init__(self, target, drafter=None, config: EngineConfig = EngineConfig(), draft_policy=None, name: str | None = None):
        self.engine = Engine(target, config, drafter=drafter, draft_policy=draft_policy)
        self.name = name or (drafter.name if drafter is not None else "ar")

    @property
    def target(self):
        return self.engine.model

    @property
    def drafter(self):
        return self.engine.drafter

    @property
    def policy_version(self) -> int:
        return self.engine.target_version

    def generate_rollouts(self, prompts: list[list[int]], n_per_prompt: int, params: SamplingParams,
                          seeds: list[list[int]] | None = None) -> RolloutBatch:
        """n_per_prompt samples of each prompt. Sample i of prompt j is drawn with seeds[j][i] when given,
        else params.seed + SEED_STRIDE * j + i (params.seed None = random)."""
        if n_per_prompt < 1:
            raise InvalidParameterError(f"n_per_prompt must be >= 1, got {n_per_prompt}")
        if seeds is not None and (len(seeds) != len(prompts) or any(len(s) != n_per_prompt for s in seeds)):
            raise InvalidParameterError(f"seeds must be {len(prompts)} lists of {n_per_prompt} seeds")
        if self.engine.has_unfinished():
            raise InvalidParameterError("the rollout engine is busy with other requests")
        requests, used = [], []
        for j, prompt in enumerate(prompts):
            for i in range(n_per_prompt):
                if seeds is not None:
                    seed = seeds[j][i]
                else:
                    seed = None if params.seed is None else params.seed + SEED_STRIDE * j + i
                self.engine.add_request(prompt, dataclasses.replace(params, seed=seed, logprobs=True))
                requests.append((j, i, self.engine.waiting[-1]))
                used.append(seed)
        start = time.perf_counter()
        profile = self._run()
        wall = time.perf_counter() - start
        version = self.policy_version
        rollouts = [
            Rollout(j, i, list(r.prompt_ids), list(r.output_ids), list(r.output_logprobs), list(r.output_policy_logprobs),
                    r.finish_reason.value, r.metrics.as_dict(), version, seed)
            for (j, i, r), seed in zip(requests, used)
        ]
        return RolloutBatch(self.name, rollouts, wall, profile)

    def _run(self) -> list[StepProfile]:
        engine, profile = self.engine, []
        while engine.has_unfinished():
            free = engine.config.max_batch_size - len(engine.running)
            active = list(engine.running) + list(engine.waiting)[: max(0, free)]
            before = [len(r.metrics.draft_lengths) for r in active]
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            ks = [r.metrics.draft_lengths[-1] for r, n in zip(active, before) if len(r.metrics.draft_lengths) > n]
            profile.append(StepProfile(len(ks), seconds, ks))
        return profile


def resync_drafter(drafter) -> None:
    """Bring a drafter in line with new target weights (drafters without target-derived state: no-op)."""
    resync = getattr(drafter, "resync", None)
    if callable(resync):
        resync()


def update_policy(engines: list, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
    """Copy new policy weights into the target the local `engines` share, then re-sync each drafter. An engine with
    its own `update_policy` (a remote one: tandem.cluster.rl) is handed the weights instead.

    Returns seconds spent: "target" (validate + copy + repack) and "resync/<drafter>" per engine.
    """
    timings = {}
    for e in engines:
        if callable(getattr(e, "update_policy", None)):
            timings |= {f"{e.name}/{k}": v for k, v in e.update_policy(named_tensors, version).items()}
    local = [e for e in engines if not callable(getattr(e, "update_policy", None))]
    if not local:
        return timings
    first = local[0]
    if any(e.target is not first.target for e in local):
        raise InvalidParameterError("update_policy: the rollout engines must share one target model")
    t0 = time.perf_counter()
    first.engine.update_target(named_tensors, version)
    timings["target"] = time.perf_counter() - t0
    for e in local:
        if e is not first:
            e.engine.update_target({}, version)  # same weights (shared); resets its KV rows and version
        t0 = time.perf_counter()
        if e.drafter is not None:
            resync_drafter(e.drafter)
        timings[f"resync/{e.name}"] = time.perf_counter() - t0
    return timings
