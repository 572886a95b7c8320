"""The GRPO learner as a Ray actor, behind the interface GRPOTrainer and the checkpoint use.

`LearnerActor` owns a tandem.rl.learner.Learner (the trainable policy, AdamW, the schedule, the frozen KL
reference): placed by Ray where its resources are (`Placement`: CPUs, a GPU), as NeMo-RL and veRL place their
policy workers. `RemoteLearner` is what GRPOTrainer sees: `version`, `update(...)`, `named_tensors()`,
`checkpoint()` / `restore(...)`. The new policy after an update never passes through the driver: the actor
returns it as safetensors bytes into Ray's object store once (`policy`), and `named_tensors()` hands that
reference (`PolicyRef`) to the rollout workers' broadcast (tandem.cluster.rl.RemoteRolloutEngine). Rollouts go
to the actor as plain dicts, tensors as safetensors bytes: nothing here unpickles a tensor.

The learner actor is never restarted (max_restarts 0): a restarted one would hold the initial policy and a fresh
optimizer and training would go on from there as if nothing happened. Its death ends the run with `LearnerDied`,
and `--resume` continues from the last checkpoint (saved after every step with `--checkpoint`).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from tandem.cluster.ray_env import pin_to_cores
from tandem.cluster.specs import Placement
from tandem.cluster.wire import tensors_from_bytes, tensors_to_bytes
from tandem.errors import InvalidParameterError, TandemError


class LearnerDied(TandemError):
    """The learner actor died: its policy and optimizer state since the last checkpoint are gone."""


def learner_died_message(during: str, error: Exception) -> str:
    return (f"the learner actor died while {during} ({type(error).__name__}); the policy and optimizer state it held are lost: "
            "rerun with --resume DIR (the --checkpoint directory) to continue from the last step saved")


class LearnerActor:
    def __init__(self, model: str, cfg, threads: int = 1, cores: tuple[int, ...] | None = None):
        from tandem.models.loader import load_transformer
        from tandem.rl.learner import Learner

        self.cores = pin_to_cores(cores)
        torch.set_num_threads(threads)
        reference = load_transformer(model) if cfg.kl_coef > 0 else None
        self.learner = Learner(load_transformer(model), cfg, reference=reference)

    def update(self, rollouts: list[dict], advantages: list[float], step: int) -> dict:
        from tandem.rl.rollout import Rollout

        stats = self.learner.update([Rollout(**r) for r in rollouts], torch.tensor(advantages, dtype=torch.float32), step)
        return {"stats": stats, "version": self.learner.version}

    def policy(self) -> bytes:
        return tensors_to_bytes(self.learner.named_tensors())

    def checkpoint(self) -> tuple[bytes, bytes, dict, float]:
        policy, moments, state, lr = self.learner.checkpoint()
        return tensors_to_bytes(policy), tensors_to_bytes(moments), state, lr

    def restore(self, policy: bytes, moments: bytes, state: dict) -> int:
        self.learner.restore(tensors_from_bytes(policy)[0], tensors_from_bytes(moments)[0], state)
        return self.learner.version

    def status(self) -> dict:
        return {"version": self.learner.version, "optimizer_steps": self.learner.optimizer_steps, "cores": list(self.cores), "pid": os.getpid()}


@dataclasses.dataclass(frozen=True)
class PolicyRef:
    """The learner's current policy in the object store (safetensors bytes), for a broadcast to rollout workers."""

    ref: object  # ray.ObjectRef


class RemoteLearner:
    def __init__(self, actor):
        self.actor = actor
        self.version = self._get(actor.status.remote(), "starting")["version"]

    @staticmethod
    def _get(ref, during: str):
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(ref)
        except RayActorError as e:
            raise LearnerDied(learner_died_message(during, e)) from e

    def update(self, rollouts: list, advantages: torch.Tensor, step: int, online=None) -> dict:
        if online is not None:
            raise InvalidParameterError("a remote learner does not train an online EAGLE head")
        out = self._get(self.actor.update.remote([dataclasses.asdict(r) for r in rollouts], advantages.tolist(), step), f"updating the policy at step {step}")
        self.version = out["version"]
        return out["stats"]

    def named_tensors(self) -> PolicyRef:
        return PolicyRef(self.actor.policy.remote())

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict, float]:
        policy, moments, state, lr = self._get(self.actor.checkpoint.remote(), "saving a checkpoint")
        return tensors_from_bytes(policy)[0], tensors_from_bytes(moments)[0], state, lr

    def restore(self, policy: dict[str, torch.Tensor], moments: dict[str, torch.Tensor], state: dict) -> None:
        self.version = self._get(self.actor.restore.remote(tensors_to_bytes(policy), tensors_to_bytes(moments), state), "restoring a checkpoint")


def learner_actor(model: str, cfg, placement: Placement = Placement(), threads: int = 1):
    """Start the learner actor; never restarted (see the module's docstring), whatever placement.max_restarts says."""
    import ray

    actor = ray.remote(LearnerActor).options(**dataclasses.replace(placement, max_restarts=0).options())
    return actor.remote(model, cfg, threads, placement.cores)
