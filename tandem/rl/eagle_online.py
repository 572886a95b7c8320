"""Online EAGLE training during RL: the head follows the policy on the learner's own forward.

The learner's forward over the rollouts computes the policy's hidden states anyway (for the policy
loss); the head trains on those taps, the final hidden state and the policy's LM-head rows, all
detached, so the draft loss never reaches the policy's gradients (test: bit-identical policy grads with
and without it). A separate trainable copy is optimised; `publish()` copies it into the served head
between rollouts (in place, then repacked) and bumps the drafter's version. Staleness = the current
policy version minus the policy version the head last trained on.
"""
from __future__ import annotations

import time

import torch

from tandem.flywheel.trainer import trainer_copy
from tandem.models.head_state import install_trainable, trainable_state
from tandem.training.offline import Example, eagle_step, sample_roots


class OnlineEagle:
    def __init__(self, drafter, lr: float = 1e-3, unroll: int = 3, chain_fraction: float = 0.5, seed: int = 0):
        self.drafter = drafter  # the served EagleDrafter (its head is only written by publish())
        self.head = trainer_copy(drafter.head).train()
        self.optimizer = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        self.unroll, self.chain_fraction = unroll, chain_fraction
        self.generator = torch.Generator().manual_seed(seed)
        self.trained_version = -1  # policy version of the last data it trained on (-1 = never)
        self.steps = 0

    @property
    def taps(self) -> tuple[int, ...]:
        return self.head.cfg.taps

    def examples(
        self,
        ids: torch.Tensor,  # [B, L] prompt + completion, right-padded
        lengths: list[int],  # [B] real lengths
        prompt_lens: list[int],  # [B]
        taps: tuple[torch.Tensor, ...],  # 3 x [B, L, d] from the learner's forward
        final_hidden: torch.Tensor,  # [B, L, d]
        greedy: torch.Tensor,  # [B, L] long: the policy's argmax at each position (accuracy stats only)
    ) -> list[Example]:
        """Per-sequence training examples from the learner's forward, detached from the policy graph."""
        with torch.no_grad():
            tapped = torch.cat([h.detach().float() for h in taps], dim=-1)
            return [Example(ids[b, :n].clone(), tapped[b, :n].clone(), final_hidden[b, :n].detach().float().clone(), greedy[b, :n].clone(), p)
                    for b, (n, p) in enumerate(zip(lengths, prompt_lens))]

    def target_rows(self, policy) -> torch.Tensor:  # [Vd, d] the policy's LM-head rows of the draft vocabulary (detached)
        return policy.lm_head.weight.detach().float()[self.head.draft_to_target.cpu()]

    def loss(self, examples: list[Example], target_rows: torch.Tensor) -> torch.Tensor:
        length = max(len(e.tokens) for e in examples)
        roots = sample_roots(length, self.chain_fraction, self.generator)
        return eagle_step(self.head, target_rows, examples, self.unroll, roots).loss

    def train_on(self, examples: list[Example], target_rows: torch.Tensor, policy_version: int) -> dict:
        start = time.perf_counter()
        loss = self.loss(examples, target_rows)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.trained_version = policy_version
        self.steps += 1
        return {"draft_loss": float(loss.detach()), "draft_train_s": time.perf_counter() - start}

    def publish(self) -> None:
        """Copy the trained weights into the served head in place (between rollouts only) and repack what they
        changed; a shared LM head (frozen in both copies) is left as it is."""
        install_trainable(self.drafter.head, trainable_state(self.head))
        self.drafter.version += 1

    def staleness(self, policy_version: int) -> int | None:
        return None if self.trained_version < 0 else policy_version - self.trained_version
