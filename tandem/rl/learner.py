"""The GRPO learner: a trainable, unpacked copy of the policy on tandem's own Transformer, AdamW, a
warm-up + schedule for the learning rate, an optional frozen reference for the KL term.

`update(rollouts, advantages)` is one GRPO step: `ppo_epochs` passes over the batch in `mini_batches`
optimiser steps each (micro-batches accumulate gradients inside a mini-batch). Samples with zero
advantage carry no gradient when there is no KL term and no online drafter: they are skipped in the
forward and backward, the divisor of their mini-batch unchanged. In async mode the ratio is anchored
to a proximal policy: the learner's own log-probs from a no-grad pass before the update (AReaL's
decoupled PPO), with the behaviour policy's truncated importance weight.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from tandem.errors import TandemError

from tandem.ops.rl import aggregation_divisor, entropy_sum, policy_loss, token_weights


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning rate's multiplier at optimiser step `step` (0-based): linear warm-up, then the schedule."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


class Learner:
    """The trainable policy; `version` counts GRPO updates, `optimizer_steps` the optimiser's steps."""

    def __init__(self, model, cfg, taps: tuple[int, ...] = (), reference=None):
        model.unpack()
        model.train().requires_grad_(True)
        if not cfg.train_embeddings:
            model.embed.weight.requires_grad_(False)
        self.model, self.cfg, self.taps = model, cfg, tuple(taps)
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        total = cfg.steps * cfg.ppo_epochs * cfg.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule, cfg.min_lr_ratio))
        self.version = 0
        self.optimizer_steps = 0

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter, once (tied weights under their first name): what update_policy copies."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    # ---- forward -------------------------------------------------------------------------------------
    def _batch(self, rollouts: list):  # -> ids [B, L], lengths, prompt_lens, rows, cols (completion positions)
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        ids = torch.zeros(len(rollouts), max(lengths), dtype=torch.long)
        rows, cols = [], []
        for b, r in enumerate(rollouts):
            ids[b, : lengths[b]] = torch.tensor(r.prompt_ids + r.completion_ids)
            p, n = len(r.prompt_ids), len(r.completion_ids)
            rows += [b] * n
            cols += list(range(p - 1, p - 1 + n))  # logits at position t predict token t + 1
        return ids, lengths, [len(r.prompt_ids) for r in rollouts], torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)

    def _logprobs(self, model, rollouts: list, taps=()):  # -> (logprobs [M], logits [M, V], ForwardOutput, batch)
        ids, lengths, prompt_lens, rows, cols = self._batch(rollouts)
        out = model(ids, taps=taps, logits=False)
        logits = model.lm_head(out.final_hidden[rows, cols]).float() / self.cfg.temperature  # [M, V]: completion positions only
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[rows, cols + 1].unsqueeze(-1)).squeeze(-1)
        return logprobs, logits, out, (ids, lengths, prompt_lens)

    @torch.no_grad()
    def logprobs(self, rollouts: list, reference: bool = False) -> torch.Tensor:  # [M]: the learner's (or reference's), no grad
        chunks = []
        model = self.reference if reference else self.model
        for i in range(0, len(rollouts), self.cfg.micro_batch):
            chunks.append(self._logprobs(model, rollouts[i : i + self.cfg.micro_batch])[0])
        return torch.cat(chunks) if chunks else torch.zeros(0)

    # ---- one GRPO update ---------------------------------------------------------------------------------
    def update(self, rollouts: list, advantages: torch.Tensor, step: int, online=None) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        per_sample = self._per_sample_extras(rollouts)
        stats = {"tokens": 0, "ratio_sum": 0.0, "ratio_max": 0.0, "clipped_tokens": 0, "kl_sum": 0.0, "importance_sum": 0.0,
                 "entropy_sum": 0.0, "skipped_samples": 0, "grad_norms": [], "lrs": []}
        examples = []
        for epoch in range(cfg.ppo_epochs):
            for chosen in self._mini_batches(len(rollouts), step, epoch):
                examples += self._optimizer_step(rollouts, advantages, chosen, per_sample, stats, online, first_epoch=epoch == 0)
        trained_on = self.version
        self.version += 1
        n = max(1, stats["tokens"])
        out = {"train_s": time.perf_counter() - start, "grad_norm": float(np.mean(stats["grad_norms"])),
               "lr": stats["lrs"][-1], "ratio_mean": stats["ratio_sum"] / n if stats["tokens"] else 1.0,
               "ratio_max": stats["ratio_max"], "clip_fraction": stats["clipped_tokens"] / n, "kl": stats["kl_sum"] / n,
               "entropy": stats["entropy_sum"] / n if stats["tokens"] else None,  # None: every sample was skipped
               "importance_mean": stats["importance_sum"] / n,
               "skipped_samples": stats["skipped_samples"], "optimizer_steps": self.optimizer_steps}
        if online is not None:
            out |= online.train_on(examples, online.target_rows(self.model), trained_on)
        return out

    def _per_sample_extras(self, rollouts: list) -> list[dict]:
        """Per sample: the proximal log-probs (async: a no-grad pass of the current learner) and the reference's."""
        extras = [{} for _ in rollouts]
        if self.cfg.async_mode:
            self._split_into(extras, "proximal", self.logprobs(rollouts), rollouts)
        if self.reference is not None and self.cfg.kl_coef > 0:
            self._split_into(extras, "reference", self.logprobs(rollouts, reference=True), rollouts)
        return extras

    @staticmethod
    def _split_into(extras: list[dict], key: str, flat: torch.Tensor, rollouts: list) -> None:
        offset = 0
        for e, r in zip(extras, rollouts):
            e[key] = flat[offset : offset + len(r.completion_ids)]
            offset += len(r.completion_ids)

    def _mini_batches(self, n: int, step: int, epoch: int) -> list[list[int]]:
        """A shuffled split into cfg.mini_batches parts (one part, unshuffled, when there is only one)."""
        if self.cfg.mini_batches == 1:
            return [list(range(n))]
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg.seed, 3, step, epoch]))
        order = rng.permutation(n).tolist()
        return [order[i :: self.cfg.mini_batches] for i in range(self.cfg.mini_batches) if order[i :: self.cfg.mini_batches]]

    def _optimizer_step(self, rollouts, advantages, chosen, per_sample, stats, online, first_epoch: bool) -> list:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        lengths = [len(rollouts[i].completion_ids) for i in chosen]
        divisor = aggregation_divisor(lengths, cfg.loss_agg, cfg.max_tokens)
        skip = cfg.skip_zero_advantage and online is None and not (self.reference is not None and cfg.kl_coef > 0)
        active = [i for i in chosen if not (skip and float(advantages[i]) == 0.0)]
        stats["skipped_samples"] += len(chosen) - len(active)
        examples = []
        active.sort(key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))  # similar lengths: little padding
        for k in range(0, len(active), cfg.micro_batch):
            part = active[k : k + cfg.micro_batch]
            loss, ex = self._micro_loss([rollouts[i] for i in part], advantages[part], [per_sample[i] for i in part], stats,
                                        online if first_epoch else None)
            (loss / divisor).backward()
            examples += ex
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0)) if active else 0.0
        stats["lrs"].append(self.optimizer.param_groups[0]["lr"])
        stats["grad_norms"].append(grad_norm)
        if active:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return examples

    def _micro_loss(self, rollouts: list, advantages: torch.Tensor, extras: list[dict], stats: dict, online):
        taps = self.taps if online is not None else ()
        new, logits, out, (ids, lengths, prompt_lens) = self._logprobs(self.model, rollouts, taps)
        counts = torch.tensor([len(r.completion_ids) for r in rollouts])
        sample_of = torch.repeat_interleave(torch.arange(len(rollouts)), counts)
        behaviour = torch.tensor([lp for r in rollouts for lp in r.logprobs], dtype=new.dtype)
        proximal = torch.cat([e["proximal"] for e in extras]) if "proximal" in extras[0] else None
        reference = torch.cat([e["reference"] for e in extras]) if "reference" in extras[0] else None
        weights = token_weights(sample_of, counts, self.cfg.loss_agg)
        loss, s = policy_loss(new, behaviour, advantages[sample_of], weights, self.cfg.clip_low, self.cfg.clip_high,
                              proximal_logprobs=proximal, behaviour_cap=self.cfg.behaviour_cap,
                              ref_logprobs=reference, kl_coef=self.cfg.kl_coef)
        stats["tokens"] += s["tokens"]
        stats["ratio_sum"] += s["ratio_sum"]
        stats["ratio_max"] = max(stats["ratio_max"], s["ratio_max"])
        stats["clipped_tokens"] += s["clipped_tokens"]
        stats["kl_sum"] += s["kl_sum"]
        stats["importance_sum"] += s["importance_mean"] * s["tokens"]
        stats["entropy_sum"] += entropy_sum(logits)
        examples = []
        if online is not None:
            examples = online.examples(ids, lengths, prompt_lens, out.hidden, out.final_hidden, self._greedy(out.final_hidden))
        return loss, examples

    def _greedy(self, final_hidden: torch.Tensor) -> torch.Tensor:  # [B, L, d] -> [B, L]: the policy's argmax everywhere (no gradient)
        with torch.no_grad():
            return self.model.lm_head(final_hidden.detach()).argmax(-1)

    # ---- what a checkpoint keeps ------------------------------------------------------------------------
    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict, float]:
        """(policy tensors, optimizer moments, loop state, current lr): all a checkpoint keeps of the learner."""
        from tandem.rl.checkpoint import optimizer_tensors

        return self.named_tensors(), optimizer_tensors(self.optimizer, self._trainable()), self.state(), self.optimizer.param_groups[0]["lr"]

    def restore(self, policy: dict[str, torch.Tensor], moments: dict[str, torch.Tensor], state: dict) -> None:
        from tandem.rl.checkpoint import load_optimizer_tensors

        params = dict(self.model.named_parameters())
        if set(policy) != set(params):
            raise TandemError("the checkpoint's parameters do not match the policy")
        with torch.no_grad():
            for name, tensor in policy.items():
                params[name].copy_(tensor)
        load_optimizer_tensors(self.optimizer, self._trainable(), moments)
        self.load_state(state)

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def state(self) -> dict:
        return {"policy_version": self.version, "optimizer_steps": self.optimizer_steps, "scheduler": self.scheduler.state_dict()}

    def load_state(self, state: dict) -> None:
        self.version, self.optimizer_steps = int(state["policy_version"]), int(state["optimizer_steps"])
        self.scheduler.load_state_dict(state["scheduler"])
