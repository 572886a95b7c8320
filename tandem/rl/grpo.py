"""GRPO on reasoning tasks with speculative rollouts.

Each step: rollouts (n samples per prompt, speculative) -> rewards (reasoning-gym's scorers) ->
group-relative advantages -> the learner's update (tandem.rl.learner: clipped objective, aggregation,
KL, PPO epochs / mini-batches) -> `update_policy` copies the new weights into the rollout engines'
target and re-syncs the drafters (self_draft re-quantizes; an online EAGLE head trains on the
learner's own forward, detached, and is published; suffix drafters keep their history).

Sync mode runs those phases in order. Async mode overlaps the rollouts of step t+1 (on the weights of
step t) with the update of step t in a thread, so the learner trains one version off-policy; the
objective is then anchored to the learner's current policy (decoupled PPO, see tandem.rl.learner).
Rewards are always computed on the trainer's own thread (math-verify's timeouts use signal.alarm).

Two scores per completion: the reward that trains (reward_fn; reasoning-gym's scorers give partial credit,
e.g. "17" against "7" scores 0.5) and exact accuracy (the env's scorer gives the full 1.0), both reported.

Randomness: sample i of prompt j at step s is drawn with the seed SeedSequence([seed, 1, s, j, i]),
so no two (step, prompt, sample) share a stream; held-out evaluation uses [seed, 2, j] at every eval.
With several rollout engines (`--compare`), every engine decodes the same prompts with the same seeds
and weights each step (order rotated per step); the learner trains on the first engine's rollouts.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.ops.rl import AGGREGATIONS, group_advantages
from tandem.rl.envs import EnvConfig, Problem, ReasoningEnv, wilson_interval
from tandem.rl.learner import Learner
from tandem.rl.rewards import reasoning_gym_reward
from tandem.rl.rollout import RolloutBatch, RolloutEngine, update_policy

TRAIN_STREAM, EVAL_STREAM = 1, 2


def sample_seed(seed: int, stream: int, *indices: int) -> int:
    """A 63-bit seed from numpy's SeedSequence over (seed, stream, indices...): distinct tuples, distinct streams."""
    return int(np.random.SeedSequence([seed, stream, *indices]).generate_state(1, dtype=np.uint64)[0]) >> 1


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 20  # GRPO steps (rollout batches)
    prompts_per_step: int = 4  # groups per step
    group_size: int = 8  # samples per prompt
    max_tokens: int = 256  # completion length at most
    temperature: float = 1.0  # rollout temperature (the learner's log-probs use the same)
    lr: float = 5e-6  # peak learning rate
    warmup_steps: int = 0  # optimiser steps of linear warm-up
    lr_schedule: str = "constant"  # after warm-up: constant | linear | cosine (to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.1
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # > clip_low is DAPO's clip-higher (e.g. 0.28)
    loss_agg: str = "seq_mean_token_mean"  # | token_mean (DAPO) | seq_mean_token_sum_norm (Dr. GRPO)
    scale_adv_by_std: bool = True  # False: Dr. GRPO's unnormalised advantages
    kl_coef: float = 0.0  # > 0: k3 KL to the frozen initial policy
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimiser steps per pass
    micro_batch: int = 8  # sequences per learner forward/backward (gradients accumulate)
    skip_zero_advantage: bool = True  # samples with advantage 0 skip forward/backward (the divisor unchanged)
    behaviour_cap: float = 5.0  # async: truncation of the behaviour importance weight
    train_embeddings: bool = False  # the (tied) embedding stays frozen by default: less time and memory
    eval_problems: int = 128  # held-out problems (never trained on)
    eval_every: int = 5  # steps between held-out evaluations (and at the start and the end)
    async_mode: bool = False  # overlap the rollouts of step t+1 with the update of step t
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "micro_batch", "eval_every", "ppo_epochs", "mini_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 0 < self.temperature <= 10 or self.lr <= 0 or self.eval_problems < 0 or self.warmup_steps < 0:
            raise InvalidParameterError("need 0 < temperature <= 10, lr > 0, eval_problems >= 0, warmup_steps >= 0")
        if not (0 < self.clip_low < 1 and 0 < self.clip_high) or self.kl_coef < 0 or self.behaviour_cap < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise InvalidParameterError("need 0 < clip_low < 1, clip_high > 0, kl_coef >= 0, behaviour_cap >= 1, 0 <= min_lr_ratio <= 1")
        if self.loss_agg not in AGGREGATIONS:
            raise InvalidParameterError(f"loss_agg must be one of {AGGREGATIONS}, got {self.loss_agg!r}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise InvalidParameterError(f"lr_schedule must be constant, linear or cosine, got {self.lr_schedule!r}")
        if self.group_size < 2:
            raise InvalidParameterError("group_size must be >= 2 (advantages are relative to the group)")
        if self.mini_batches > self.prompts_per_step * self.group_size:
            raise InvalidParameterError("mini_batches must be <= the rollouts per step")

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "env"} | {"env": self.env.as_dict()}


class GRPOTrainer:
    def __init__(self, learner: Learner, engines: list[RolloutEngine], tokenizer, cfg: GRPOConfig, online=None, reward_fn=reasoning_gym_reward):
        if not engines:
            raise InvalidParameterError("GRPO needs at least one rollout engine")
        self.learner, self.engines, self.tokenizer, self.cfg = learner, engines, tokenizer, cfg
        self.online, self.reward_fn = online, reward_fn
        self.env = ReasoningEnv(cfg.env, seed=cfg.seed, held_out_size=cfg.eval_problems)
        self.held_out = self.env.held_out
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.step_index = 0

    # ---- phases -----------------------------------------------------------------------------------------
    def step_problems(self, step: int) -> list[Problem]:
        return self.env.step_problems(step, self.cfg.prompts_per_step)

    def rollouts(self, step: int) -> tuple[list[Problem], dict[str, RolloutBatch]]:
        """Every engine decodes the same prompts with the same seeds; order rotates per step."""
        batch_problems = self.step_problems(step)
        prompts = [self.env.render(p, self.tokenizer) for p in batch_problems]
        seeds = [[sample_seed(self.cfg.seed, TRAIN_STREAM, step, j, i) for i in range(self.cfg.group_size)] for j in range(len(prompts))]
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
        order = self.engines[step % len(self.engines):] + self.engines[: step % len(self.engines)]
        batches = {e.name: e.generate_rollouts(prompts, self.cfg.group_size, params, seeds=seeds) for e in order}
        return batch_problems, {e.name: batches[e.name] for e in self.engines}

    def score(self, batch: RolloutBatch, batch_problems: list[Problem]) -> dict:
        """Per rollout: "rewards" [N] (reward_fn: may give partial credit) and "exact" [N] (1.0 where the env's scorer
        gives the tagged answer the full score, see ReasoningEnv.exact), and "reward_s". Runs on the calling thread:
        rewards may use signal-based timeouts (math-verify's), which work only on the main thread."""
        t0 = time.perf_counter()
        texts = self.tokenizer.batch_decode([r.completion_ids for r in batch.rollouts], skip_special_tokens=True)
        problems = [batch_problems[r.prompt_index] for r in batch.rollouts]
        rewards = torch.tensor([float(self.reward_fn(t, p, self.env)) for t, p in zip(texts, problems)])
        exact = torch.tensor([float(self.env.exact(p, t)) for t, p in zip(texts, problems)])
        return {"rewards": rewards, "exact": exact, "reward_s": time.perf_counter() - t0}

    def update(self, batch: RolloutBatch, batch_problems: list[Problem], step: int, scored: dict | None = None) -> dict:
        """The learner's update on `batch`, scored here unless `scored` (score()'s result) is given."""
        scored = scored if scored is not None else self.score(batch, batch_problems)
        rewards = scored["rewards"]
        groups = torch.tensor([r.prompt_index for r in batch.rollouts])
        advantages = group_advantages(rewards, groups, scale_by_std=self.cfg.scale_adv_by_std)
        stats = self.learner.update(batch.rollouts, advantages, step, self.online)
        versions = [r.policy_version for r in batch.rollouts]
        lengths = [len(r.completion_ids) for r in batch.rollouts]
        return stats | {"reward_s": scored["reward_s"], "reward_mean": float(rewards.mean()), "exact_mean": float(scored["exact"].mean()),
                        "sample_staleness": self.learner.version - 1 - min(versions), "completion_tokens_mean": float(np.mean(lengths)),
                        "truncated_share": float(np.mean([n >= self.cfg.max_tokens for n in lengths]))}

    def sync(self) -> dict:
        start = time.perf_counter()
        timings = update_policy(self.engines, self.learner.named_tensors(), self.learner.version)
        if self.online is not None:
            t0 = time.perf_counter()
            self.online.publish()
            timings["publish/eagle"] = time.perf_counter() - t0
        return {"sync_s": time.perf_counter() - start, "sync": {k: round(v, 4) for k, v in timings.items()}}

    def evaluate(self) -> dict:
        """Held-out reward ("greedy", "sampled") and exact accuracy ("greedy_exact", "sampled_exact"), each with its 95 %
        Wilson interval: greedy and one sample at the rollout temperature."""
        if not self.held_out:
            return {}
        t0 = time.perf_counter()
        prompts = [self.env.render(p, self.tokenizer) for p in self.held_out]
        out = {"step": self.step_index, "policy_version": self.engines[0].policy_version, "problems": len(prompts)}
        for name, temperature in (("greedy", 0.0), ("sampled", self.cfg.temperature)):
            seeds = [[sample_seed(self.cfg.seed, EVAL_STREAM, j)] for j in range(len(prompts))]
            batch = self.engines[0].generate_rollouts(prompts, 1, SamplingParams(max_tokens=self.cfg.max_tokens, temperature=temperature), seeds=seeds)
            scored = self.score(batch, self.held_out)
            for key, values in ((name, scored["rewards"]), (f"{name}_exact", scored["exact"])):
                low, high = wilson_interval(float(values.sum()), len(values))
                out[key] = float(values.mean())
                out[f"{key}_ci95"] = [round(low, 4), round(high, 4)]
            out[f"{name}_tokens_mean"] = float(np.mean([len(r.completion_ids) for r in batch.rollouts]))
        out["eval_s"] = time.perf_counter() - t0
        self.evals.append(out)
        return out

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, steps: int | None = None, on_step=None) -> list[dict]:
        steps = self.cfg.steps if steps is None else steps
        end = self.step_index + steps
        if not self.evals or self.evals[-1]["step"] != self.step_index:
            self.evaluate()
        pending = self.rollouts(self.step_index) if self.cfg.async_mode and self.step_index < end else None
        while self.step_index < end:
            start = time.perf_counter()
            if self.cfg.async_mode:
                record, pending = self._async_step(pending, self.step_index + 1 < end)
            else:
                record = self._sync_step()
            record["step_wall_s"] = time.perf_counter() - start  # rollouts + rewards + update + sync, not the eval
            self.history.append(record)
            self.step_index += 1
            if self.step_index % self.cfg.eval_every == 0 or self.step_index == end:
                record["eval"] = self.evaluate()
            if on_step is not None:
                on_step(record)
        return self.history

    def _sync_step(self) -> dict:
        t0 = time.perf_counter()
        batch_problems, batches = self.rollouts(self.step_index)
        rollout_wall = time.perf_counter() - t0
        stats = self.update(batches[self.engines[0].name], batch_problems, self.step_index)
        return self._record(batches, stats, rollout_wall) | self.sync()

    def _async_step(self, pending, more: bool):
        """Update on `pending` (from the previous weights) in a thread while the next rollouts run. The rewards are
        computed first, on this thread (see score)."""
        batch_problems, batches = pending
        result: dict = {}
        step = self.step_index
        primary = batches[self.engines[0].name]
        scored = self.score(primary, batch_problems)

        def work():
            try:
                result["stats"] = self.update(primary, batch_problems, step, scored)
            except BaseException as e:  # re-raised in the caller's thread
                result["error"] = e

        worker = threading.Thread(target=work, name="grpo-update")
        t0 = time.perf_counter()
        worker.start()
        upcoming = self.rollouts(self.step_index + 1) if more else None
        rollout_wall = time.perf_counter() - t0
        worker.join()
        if "error" in result:
            raise result["error"]
        record = self._record(batches, result["stats"], rollout_wall, overlapped=True)
        return record | self.sync(), upcoming

    def _record(self, batches: dict[str, RolloutBatch], stats: dict, rollout_wall: float, overlapped: bool = False) -> dict:
        primary = batches[self.engines[0].name]
        record = {
            "step": self.step_index, "policy_version": self.learner.version, "overlapped": overlapped,
            "rollout_phase_s": rollout_wall,
            "rollout_s": {n: b.wall_s for n, b in batches.items()},
            "acceptance_length": {n: round(b.acceptance_length(), 4) for n, b in batches.items()},
            "decisions": {n: b.decisions() for n, b in batches.items()},
            "profiles": {n: [(p.batch, round(p.seconds, 5), round(sum(p.ks) / len(p.ks), 2) if p.ks else 0.0) for p in b.profile]
                         for n, b in batches.items()},  # per engine step: live batch, seconds, mean draft length chosen
            "drafter_versions": {e.name: (e.drafter.version if e.drafter is not None else 0) for e in self.engines},
            "tokens": sum(len(r.completion_ids) for r in primary.rollouts),
            "rollout_tokens": {n: sum(len(r.completion_ids) for r in b.rollouts) for n, b in batches.items()},
            "completion_lengths": {n: [len(r.completion_ids) for r in b.rollouts] for n, b in batches.items()},  # `tandem simulate --rollout`
            "same_rollouts": {n: [r.completion_ids for r in b.rollouts] == [r.completion_ids for r in primary.rollouts]
                              for n, b in batches.items()},  # seeded draws: speculation decodes the first engine's tokens
            "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in primary.rollouts])),
        } | stats
        if self.online is not None:
            record["eagle_staleness"] = self.online.staleness(self.learner.version)
        return record
