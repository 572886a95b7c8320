"""RL on Ray: rollout workers as actors, behind RolloutEngine's interface, the learner as an actor
(tandem.cluster.learner), and the GRPO trainer over them.

`RolloutWorker` (an actor) owns a RolloutEngine: its own packed copy of the policy and its drafter.
`RemoteRolloutEngine` is what GRPOTrainer sees: `name`, `generate_rollouts`, `policy_version`, `drafter`
(its `.version`), and `update_policy(named_tensors, version)`. `generate_rollouts` gives each worker a
contiguous slice of the prompts and shifts its seed so that every sample keeps the seed it has in one
process (params.seed + SEED_STRIDE * prompt + sample): the same rollouts as the embedded engine. A policy
update is `ray.put` once (safetensors bytes) and every worker copies it into its target (validated by
Engine.update_target) and re-syncs its drafter.

GRPOTrainer.sync() calls tandem.rl.rollout.update_policy(engines, ...), which hands the weights to an engine's own
`update_policy` where it has one (this proxy: one broadcast), so GRPOTrainer runs unchanged on remote engines.

A rollout worker that dies is restarted by Ray (Placement.max_restarts); its slice of the prompts is decoded again
(at most WORKER_RETRIES times) once the restarted worker holds the policy the others decode with: the policy last
broadcast is pushed to it first, and a worker never decodes with another version (`generate` checks). Per-sample
seeds make the retried rollouts the same as the lost ones. A worker that does not come back ends the step with
`RolloutWorkerDied`, naming it; `--resume` continues from the last checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from tandem.cluster.learner import LearnerDied, PolicyRef, RemoteLearner, learner_actor, learner_died_message
from tandem.cluster.ray_env import pin_to_cores
from tandem.cluster.specs import Placement
from tandem.cluster.wire import tensors_from_bytes, tensors_to_bytes
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError, TandemError
from tandem.rl.rollout import SEED_STRIDE, Rollout, RolloutBatch, StepProfile, update_policy

WORKER_RETRIES = 2  # re-decodes of one worker's slice in one call after it died
RESTART_TIMEOUT_S = 300.0  # a restarted worker imports torch and loads the model again
log = logging.getLogger("tandem.cluster")


class RolloutWorkerDied(TandemError):
    """A rollout worker died and did not come back (or kept dying) within WORKER_RETRIES tries."""


class RolloutWorker:
    def __init__(self, model: str, drafter: str, max_batch: int, max_len: int, num_draft_tokens: int = 4, adaptive_k: bool = True,
                 threads: int = 1, cores: tuple[int, ...] | None = None):
        from tandem.models.loader import load_transformer
        from tandem.models.zoo import resolve_model
        from tandem.rl.setup import build_engines

        self.cores = pin_to_cores(cores)
        torch.set_num_threads(threads)
        target = load_transformer(resolve_model(model))
        target.pack()
        [self.engine] = build_engines(target, [drafter], max_batch, max_len, num_draft_tokens, adaptive_k, model_name=model)

    def generate(self, prompts: list[list[int]], n_per_prompt: int, params: dict, first_prompt: int, seeds: list[list[int]] | None = None,
                 policy_version: int | None = None) -> dict:
        """The rollouts of `prompts`, or {"stale": version} when this worker does not hold `policy_version` (restarted)."""
        if policy_version is not None and self.engine.policy_version != policy_version:
            return {"stale": self.engine.policy_version}
        seed = params["seed"]
        shifted = SamplingParams(**dict(params, stop=tuple(params["stop"]), stop_token_ids=tuple(params["stop_token_ids"]),
                                        seed=None if seed is None else seed + SEED_STRIDE * first_prompt))
        batch = self.engine.generate_rollouts(prompts, n_per_prompt, shifted, seeds=seeds)
        rollouts = [dataclasses.replace(r, prompt_index=r.prompt_index + first_prompt) for r in batch.rollouts]
        return {"rollouts": [dataclasses.asdict(r) for r in rollouts], "wall_s": batch.wall_s, "profile": [dataclasses.asdict(p) for p in batch.profile]}

    def update_policy(self, blob: bytes, version: int) -> dict:
        tensors, _ = tensors_from_bytes(blob)
        return update_policy([self.engine], tensors, version)

    def status(self) -> dict:
        drafter = self.engine.drafter
        return {"policy_version": self.engine.policy_version, "drafter_version": drafter.version if drafter is not None else 0,
                "name": self.engine.name, "cores": list(self.cores)}


@dataclasses.dataclass
class _DrafterView:
    version: int  # the workers' drafter version (each re-syncs its own drafter; nothing to do here)


class RemoteRolloutEngine:
    def __init__(self, workers: list, name: str):
        import ray

        if not workers:
            raise InvalidParameterError("RemoteRolloutEngine needs at least one rollout worker")
        self.workers, self.name = workers, name
        self.last_sync: dict[str, float] = {}
        self.retries = 0  # worker slices decoded again after their worker died
        self._policy = None  # (object ref, version) of the policy last broadcast: what a restarted worker is given
        status = ray.get([w.status.remote() for w in workers])
        self._policy_version = status[0]["policy_version"]
        self.drafter = None if name == "ar" else _DrafterView(status[0]["drafter_version"])

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def generate_rollouts(self, prompts: list[list[int]], n_per_prompt: int, params: SamplingParams,
                          seeds: list[list[int]] | None = None) -> RolloutBatch:
        if n_per_prompt < 1:
            raise InvalidParameterError(f"n_per_prompt must be >= 1, got {n_per_prompt}")
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidParameterError(f"seeds must be {len(prompts)} lists of {n_per_prompt} seeds")
        start = time.perf_counter()
        jobs = {i: (prompts[a:b], n_per_prompt, dataclasses.asdict(params), a, None if seeds is None else seeds[a:b])
                for i, (a, b) in enumerate(_slices(len(prompts), len(self.workers))) if b > a}
        parts = self._gather(jobs)
        rollouts = [Rollout(**r) for part in parts for r in part["rollouts"]]
        profile = [StepProfile(**p) for part in parts for p in part["profile"]]
        return RolloutBatch(self.name, rollouts, time.perf_counter() - start, profile)

    def _gather(self, jobs: dict[int, tuple]) -> list[dict]:
        """Every worker's part, in worker order; a worker that died (or came back without the policy) is given the
        policy and its slice again, at most WORKER_RETRIES times."""
        import ray
        from ray.exceptions import RayActorError

        done: dict[int, dict] = {}
        pending = dict(jobs)
        for attempt in range(WORKER_RETRIES + 1):
            refs = {i: self.workers[i].generate.remote(*args, self._policy_version) for i, args in pending.items()}
            failed = {}
            for i, ref in refs.items():
                try:
                    out = ray.get(ref)
                except RayActorError as e:
                    failed[i] = f"died ({type(e).__name__})"
                    continue
                if "stale" in out:
                    failed[i] = f"came back holding policy version {out['stale']}, not {self._policy_version}"
                else:
                    done[i] = out
            if not failed:
                return [done[i] for i in sorted(jobs)]
            pending = {i: jobs[i] for i in failed}
            if attempt == WORKER_RETRIES:
                break
            for i, why in failed.items():
                log.warning("rollout worker %d of %d %s: decoding its %d prompts again (try %d of %d)", i, len(self.workers), why,
                            len(jobs[i][0]), attempt + 1, WORKER_RETRIES)
                self.retries += 1
                self._resync(i)
        i, why = next(iter(failed.items()))
        raise RolloutWorkerDied(f"rollout worker {i} of {len(self.workers)} {why} and was not back after {WORKER_RETRIES} tries; the step did not "
                                "finish: rerun with --resume DIR (the --checkpoint directory) to continue from the last step saved")

    def _resync(self, i: int) -> None:
        """Wait for worker i to be back (at most RESTART_TIMEOUT_S), then give it the policy last broadcast (a
        restarted worker holds the initial one). Still down: the next try fails fast and counts."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                status = ray.get(self.workers[i].status.remote(), timeout=max(1.0, deadline - time.monotonic()))
                if self._policy is not None and status["policy_version"] != self._policy[1]:
                    ray.get(self.workers[i].update_policy.remote(*self._policy), timeout=RESTART_TIMEOUT_S)
                return
            except ActorUnavailableError as e:  # restarting: Ray answers at once until the new process is up
                if time.monotonic() >= deadline:
                    log.warning("rollout worker %d is not back after %.0f s (%s)", i, RESTART_TIMEOUT_S, type(e).__name__)
                    return
                time.sleep(0.5)
            except (RayActorError, GetTimeoutError) as e:  # dead for good, or no answer
                log.warning("rollout worker %d is not back (%s)", i, type(e).__name__)
                return

    def update_policy(self, named_tensors: "dict[str, torch.Tensor] | PolicyRef", version: int) -> dict[str, float]:
        """The new policy into the object store once (a remote learner's is there already); every worker copies it in
        and re-syncs its drafter. A worker that dies meanwhile is given it when it is back (`_gather`)."""
        import ray
        from ray.exceptions import RayActorError

        t0 = time.perf_counter()
        ref = named_tensors.ref if isinstance(named_tensors, PolicyRef) else ray.put(tensors_to_bytes(named_tensors))  # a remote learner's is there
        put_s = time.perf_counter() - t0
        self._policy, self._policy_version = (ref, version), version
        refs = [w.update_policy.remote(ref, version) for w in self.workers]
        timings = {}
        for i, worker_ref in enumerate(refs):
            try:
                timings[i] = ray.get(worker_ref)
            except RayActorError as e:
                if e.actor_id not in (None, self.workers[i]._actor_id.hex()):  # not this worker: the learner that was to make `ref`
                    raise LearnerDied(learner_died_message("handing out the new policy", e)) from e
                log.warning("rollout worker %d died while taking policy version %d (%s); it is given it when back", i, version, type(e).__name__)
        if self.drafter is not None and timings:
            i = next(iter(timings))
            self.drafter.version = ray.get(self.workers[i].status.remote())["drafter_version"]
        self.last_sync = {"put": put_s, "workers": time.perf_counter() - t0} | {f"worker{i}/{k}": v for i, t in timings.items() for k, v in t.items()}
        return self.last_sync


def _slices(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible: prompts [a, b) per worker."""
    size, extra = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + size + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def rollout_workers(model: str, drafter: str, workers: int, max_batch: int, max_len: int, num_draft_tokens: int = 4, adaptive_k: bool = True,
                    placement: Placement = Placement(), threads: int = 1, cores: list[tuple[int, ...] | None] | None = None) -> list:
    import ray

    actor = ray.remote(RolloutWorker).options(**placement.options(max_concurrency=2))
    return [actor.remote(model, drafter, max_batch, max_len, num_draft_tokens, adaptive_k, threads, cores[i] if cores else placement.cores) for i in range(workers)]


def build_ray_trainer(model: str, drafter: str, cfg, workers: int, num_draft_tokens: int = 4, adaptive_k: bool = True, max_batch: int | None = None,
                      reward_fn=None, placement: Placement = Placement(), learner_placement: Placement = Placement()):
    """tandem.rl.setup.build_trainer with the rollouts on `workers` Ray actors and the learner on its own actor
    (`learner_placement`); rewards, evaluation and the loop stay in this process."""
    from tandem.llm import load_tokenizer
    from tandem.models.config import ModelConfig
    from tandem.models.zoo import resolve_model
    from tandem.rl.grpo import GRPOTrainer
    from tandem.rl.setup import MAX_PROMPT_TOKENS

    if drafter in ("eagle", "eagle_tree"):
        raise InvalidParameterError("--ray rollout workers: the online EAGLE head trains beside the learner; use ar, ngram or self_draft")
    if workers < 1:
        raise InvalidParameterError(f"--rollout-workers must be >= 1, got {workers}")
    path = resolve_model(model)
    max_len = min(MAX_PROMPT_TOKENS + cfg.max_tokens, ModelConfig.from_dir(path).max_position)
    batch = max_batch or min(cfg.prompts_per_step * cfg.group_size, 64)
    learner = RemoteLearner(learner_actor(str(path), cfg, learner_placement, threads=max(1, int(learner_placement.num_cpus))))
    handles = rollout_workers(str(path), drafter, workers, batch, max_len, num_draft_tokens, adaptive_k, placement)
    engine = RemoteRolloutEngine(handles, drafter)
    kwargs = {"reward_fn": reward_fn} if reward_fn is not None else {}
    return GRPOTrainer(learner, [engine], load_tokenizer(path), cfg, **kwargs)
