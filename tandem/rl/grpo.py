"""GRPO on verifiable tasks with speculative rollouts.

Each step: rollouts (n samples per prompt, speculative) -> exact-match rewards -> group-relative
advantages -> one clipped policy-gradient update of the learner (a trainable, unpacked copy of the
policy on tandem's own Transformer; AdamW) -> `update_policy` copies the new weights into the rollout
engines' target and re-syncs the drafters (self_draft re-quantizes; an online EAGLE head trains on the
learner's own forward, detached, and is published).

Sync mode runs those phases in order. Async mode overlaps the rollouts of step t+1 (on the weights of
step t) with the update of step t in a thread, so the learner trains one version off-policy: the
clipped objective's ratio exp(new - behaviour) uses the log-probs the engine recorded when sampling,
and every sample carries the policy version that produced it.

With several rollout engines (`--compare`), every engine decodes the same prompts with the same seeds
and weights each step (order rotated per step); the learner trains on the first engine's rollouts.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.ops.rl import clipped_policy_loss, group_advantages
from tandem.rl.rollout import RolloutBatch, RolloutEngine, update_policy
from tandem.rl.tasks import Problem, TaskConfig, problems, render_prompt, reward


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 20  # optimiser steps
    prompts_per_step: int = 4  # groups per step
    group_size: int = 8  # samples per prompt
    max_tokens: int = 24  # completion length at most
    temperature: float = 1.0  # rollout temperature (the learner's log-probs use the same)
    lr: float = 5e-6
    clip_eps: float = 0.2
    micro_batch: int = 8  # sequences per learner forward/backward (gradients accumulate)
    train_embeddings: bool = False  # the (tied) embedding stays frozen by default: less time and memory
    eval_problems: int = 64  # held-out problems (never trained on)
    eval_every: int = 5  # steps between held-out evaluations (and at the start and the end)
    async_mode: bool = False  # overlap the rollouts of step t+1 with the update of step t
    seed: int = 0
    task: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "micro_batch", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 0 < self.temperature <= 10 or self.lr <= 0 or not 0 < self.clip_eps < 1 or self.eval_problems < 0:
            raise InvalidParameterError("need 0 < temperature <= 10, lr > 0, 0 < clip_eps < 1, eval_problems >= 0")
        if self.group_size < 2:
            raise InvalidParameterError("group_size must be >= 2 (advantages are relative to the group)")


class Learner:
    """The trainable policy: unpacked Transformer + AdamW; `version` counts optimiser steps."""

    def __init__(self, model, cfg: GRPOConfig, taps: tuple[int, ...] = ()):
        model.unpack()
        model.train().requires_grad_(True)
        if not cfg.train_embeddings:
            model.embed.weight.requires_grad_(False)
        self.model, self.cfg, self.taps = model, cfg, tuple(taps)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.version = 0

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter, once (tied weights under their first name): what update_policy copies."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def forward(self, rollouts: list):  # -> ids [B, L], lengths, prompt_lens, ForwardOutput
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        ids = torch.zeros(len(rollouts), max(lengths), dtype=torch.long)
        for b, r in enumerate(rollouts):
            ids[b, : lengths[b]] = torch.tensor(r.prompt_ids + r.completion_ids)
        return ids, lengths, [len(r.prompt_ids) for r in rollouts], self.model(ids, taps=self.taps, logits=False)

    def losses(self, rollouts: list, advantages: torch.Tensor, total: int, online=None):
        """(policy loss of these rollouts / total, stats, draft examples): one forward with taps."""
        ids, lengths, prompt_lens, out = self.forward(rollouts)
        rows, cols, sample_of = [], [], []
        for b, (r, p) in enumerate(zip(rollouts, prompt_lens)):
            n = len(r.completion_ids)
            rows += [b] * n
            cols += list(range(p - 1, p - 1 + n))  # logits at position t predict token t + 1
            sample_of += [b] * n
        rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
        logits = self.model.lm_head(out.final_hidden[rows_t, cols_t]).float() / self.cfg.temperature  # [M, V]: completion positions only
        new = torch.log_softmax(logits, -1).gather(-1, ids[rows_t, cols_t + 1].unsqueeze(-1)).squeeze(-1)
        old = torch.tensor([lp for r in rollouts for lp in r.logprobs], dtype=new.dtype)
        sample_t = torch.tensor(sample_of, dtype=torch.long)
        loss, stats = clipped_policy_loss(new, old, advantages[sample_t], sample_t, len(rollouts), self.cfg.clip_eps)
        examples = online.examples(ids, lengths, prompt_lens, out.hidden, out.final_hidden, self._greedy(out.final_hidden)) if online is not None else []
        return loss / total, stats, examples

    def _greedy(self, final_hidden: torch.Tensor) -> torch.Tensor:  # [B, L, d] -> [B, L]: the policy's argmax everywhere (no gradient)
        with torch.no_grad():
            return self.model.lm_head(final_hidden.detach()).argmax(-1)

    def step(self, rollouts: list, advantages: torch.Tensor, online=None) -> dict:
        """One optimiser step over all rollouts (micro-batches accumulate); the draft head trains on the
        same forward's detached taps afterwards."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        examples, ratio, clip = [], [], []
        order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))
        for i in range(0, len(order), self.cfg.micro_batch):  # micro-batches of similar lengths: little padding
            chosen = order[i : i + self.cfg.micro_batch]
            loss, stats, ex = self.losses([rollouts[j] for j in chosen], advantages[chosen], len(rollouts), online)
            loss.backward()
            examples += ex
            ratio.append(stats["ratio_mean"])
            clip.append(stats["clip_fraction"])
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.optimizer.step()
        trained_on = self.version
        self.version += 1
        out = {"train_s": time.perf_counter() - start, "grad_norm": grad_norm, "ratio_mean": sum(ratio) / len(ratio), "clip_fraction": sum(clip) / len(clip)}
        if online is not None:
            out |= online.train_on(examples, online.target_rows(self.model), trained_on)
        return out


class GRPOTrainer:
    def __init__(self, learner: Learner, engines: list[RolloutEngine], tokenizer, cfg: GRPOConfig, online=None, reward_fn=reward):
        if not engines:
            raise InvalidParameterError("GRPO needs at least one rollout engine")
        self.learner, self.engines, self.tokenizer, self.cfg = learner, engines, tokenizer, cfg
        self.online, self.reward_fn = online, reward_fn
        self.held_out = problems(cfg.eval_problems, seed=cfg.seed + 10_000_019, cfg=cfg.task) if cfg.eval_problems else []
        self._held_questions = {p.question for p in self.held_out}
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.step_index = 0

    # ---- phases -----------------------------------------------------------------------------------------
    def step_problems(self, step: int) -> list[Problem]:
        return problems(self.cfg.prompts_per_step, seed=self.cfg.seed * 1_000_003 + step + 1, cfg=self.cfg.task, exclude=self._held_questions)

    def rollouts(self, step: int) -> tuple[list[Problem], dict[str, RolloutBatch]]:
        """Every engine decodes the same prompts with the same seeds; order rotates per step."""
        batch_problems = self.step_problems(step)
        prompts = [render_prompt(p, self.tokenizer) for p in batch_problems]
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature, seed=self.cfg.seed * 7919 + step)
        order = self.engines[step % len(self.engines):] + self.engines[: step % len(self.engines)]
        batches = {e.name: e.generate_rollouts(prompts, self.cfg.group_size, params) for e in order}
        return batch_problems, {e.name: batches[e.name] for e in self.engines}

    def rewards(self, batch: RolloutBatch, batch_problems: list[Problem]) -> torch.Tensor:  # [N]
        texts = self.tokenizer.batch_decode([r.completion_ids for r in batch.rollouts], skip_special_tokens=True)
        return torch.tensor([self.reward_fn(t, batch_problems[r.prompt_index]) for t, r in zip(texts, batch.rollouts)])

    def update(self, batch: RolloutBatch, batch_problems: list[Problem]) -> dict:
        rewards = self.rewards(batch, batch_problems)
        groups = torch.tensor([r.prompt_index for r in batch.rollouts])
        advantages = group_advantages(rewards, groups)
        stats = self.learner.step(batch.rollouts, advantages, self.online)
        versions = [r.policy_version for r in batch.rollouts]
        return stats | {"reward_mean": float(rewards.mean()), "sample_staleness": self.learner.version - 1 - min(versions)}

    def sync(self) -> dict:
        start = time.perf_counter()
        timings = update_policy(self.engines, self.learner.named_tensors(), self.learner.version)
        if self.online is not None:
            t0 = time.perf_counter()
            self.online.publish()
            timings["publish/eagle"] = time.perf_counter() - t0
        return {"sync_s": time.perf_counter() - start, "sync": {k: round(v, 4) for k, v in timings.items()}}

    def evaluate(self) -> dict:
        """Held-out reward: greedy and one sample at the rollout temperature, on the first engine."""
        if not self.held_out:
            return {}
        prompts = [render_prompt(p, self.tokenizer) for p in self.held_out]
        out = {"step": self.step_index, "policy_version": self.engines[0].policy_version}
        for name, params in (("greedy", SamplingParams(max_tokens=self.cfg.max_tokens, temperature=0.0)),
                             ("sampled", SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature, seed=self.cfg.seed + 17))):
            batch = self.engines[0].generate_rollouts(prompts, 1, params)
            out[name] = float(self.rewards(batch, self.held_out).mean())
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
            record["step_wall_s"] = time.perf_counter() - start
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
        stats = self.update(batches[self.engines[0].name], batch_problems)
        return self._record(batches, stats, rollout_wall) | self.sync()

    def _async_step(self, pending, more: bool):
        """Update on `pending` (from the previous weights) in a thread while the next rollouts run."""
        batch_problems, batches = pending
        result: dict = {}

        def work():
            try:
                result["stats"] = self.update(batches[self.engines[0].name], batch_problems)
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
            "profiles": {n: [(p.batch, round(p.seconds, 5)) for p in b.profile] for n, b in batches.items()},  # live batch per engine step
            "drafter_versions": {e.name: (e.drafter.version if e.drafter is not None else 0) for e in self.engines},
            "tokens": sum(len(r.completion_ids) for r in primary.rollouts),
            "rollout_tokens": {n: sum(len(r.completion_ids) for r in b.rollouts) for n, b in batches.items()},
        } | stats
        if self.online is not None:
            record["eagle_staleness"] = self.online.staleness(self.learner.version)
        return record
