"""An engine replica: the embedded server's Runtime (engine, drafter, hot-swapper, engine loop) in a Ray actor.

`RayRuntime` is tandem.server.runtime.Runtime sized from the actor's own Ray resources (`replica_config`), whose
flywheel (with --online) is a `RayFlywheel`: traces go to the trainer actor, versions come from it, and the
HotSwapper adopts them between this replica's own steps, validated as in one process. Each replica has a state
directory of its own (versions, admin history).

`EngineReplica` is the actor the flywheel cluster and benchmarks drive (`generate`, `status`); Ray Serve's
deployment (tandem.cluster.serve) wraps the same RayRuntime behind the embedded server's FastAPI app.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import replace

import torch

from tandem.cluster.ray_env import pin_to_cores
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.server.engine_loop import Event, Submission
from tandem.server.runtime import MAX_AUTO_BATCH, Runtime, ServerConfig

GENERATE_TIMEOUT_S = 600.0
KV_SHARE = 4  # the embedded server's KV budget: a quarter of the memory (tandem.server.runtime.default_kv_budget) ...
KV_MAX = 8 << 30  # ... at most 8 GiB


def replica_capacity(config: ServerConfig) -> int:
    """Requests one replica holds at once (running + queued), for sizing the calls Ray lets in: unset sizes take the
    Runtime's defaults (the batch sized from the KV budget, at most MAX_AUTO_BATCH; a queue of 4 x the batch) at their
    largest, since the replica sizes its batch only once it has loaded the model."""
    batch = config.max_batch_size or MAX_AUTO_BATCH
    return batch + (4 * batch if config.max_queue is None else config.max_queue)


def replica_config(config: ServerConfig, cpus: float, memory: int) -> ServerConfig:
    """The replica's own sizes where the command line left them unset: torch threads = its reserved CPUs (at least 1),
    KV budget = the embedded server's rule (a quarter, at most 8 GiB) applied to its memory share, not the node's."""
    threads = config.threads if config.threads is not None else max(1, int(cpus))
    kv = config.kv_cache_bytes if config.kv_cache_bytes is not None else min(KV_MAX, memory // KV_SHARE)
    return replace(config, threads=threads, kv_cache_bytes=kv)


def own_resources() -> tuple[float, int]:
    """(CPUs, bytes of memory) this actor holds: the CPUs Ray reserved for it, and the memory Ray reserved for it or
    else its CPU share of the node's memory (four 1-CPU replicas on a 4-CPU node: a quarter each)."""
    import ray

    context = ray.get_runtime_context()
    assigned = context.get_assigned_resources()
    cpus = float(assigned.get("CPU", 1.0))
    if assigned.get("memory"):
        return cpus, int(assigned["memory"])
    node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
    return cpus, memory_share(cpus, float(node["Resources"].get("CPU", 1.0)), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def memory_share(cpus: float, node_cpus: float, node_memory: int) -> int:
    """The node's memory in proportion to the CPUs held (all of it at most)."""
    return int(node_memory * min(1.0, cpus / max(node_cpus, 1e-9)))


class RayRuntime(Runtime):
    def __init__(self, config: ServerConfig, trainer=None, cores: tuple[int, ...] | None = None, poll_s: float = 0.2):
        self.trainer_actor, self._poll_s = trainer, poll_s
        self.cores = pin_to_cores(cores)
        config = replica_config(config, *own_resources())
        self._own_state = None
        if config.state_dir is None:  # replicas never share a state directory (version files, admin history)
            self._own_state = tempfile.mkdtemp(prefix="tandem-replica-")
            config = replace(config, state_dir=self._own_state)
        super().__init__(config)

    def _flywheel(self):
        from tandem.cluster.remote_flywheel import RayFlywheel
        from tandem.flywheel.loop import FlywheelOptions

        if self.trainer_actor is None:
            raise InvalidParameterError("RayRuntime with online=True needs the trainer actor")
        options = FlywheelOptions(trainer_threads=self.config.trainer_threads)
        return RayFlywheel(self.engine, self.llm.target, options, self.trainer_actor, self._poll_s)

    def status(self) -> dict:
        swapper = self.control.swapper if self.control is not None else None
        stats = self.engine.stats
        engine = {"steps": stats.steps, "drafts": stats.drafts, "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
                  "emitted_tokens": stats.emitted_tokens}
        return {"engine": engine, "pid": os.getpid(), "cores": list(self.cores), "version": self.engine.drafter.version if self.engine.drafter is not None else 0,
                "swaps": swapper.stats.as_dict() if swapper is not None else None, "loop_alive": self.loop.alive,
                "steps_failed": self.loop.steps_failed, "torch_threads": torch.get_num_threads(), "kv_cache_bytes": self.config.kv_cache_bytes,
                "max_batch_size": self.config.max_batch_size, "flywheel": self.flywheel.metrics() if self.flywheel is not None else None}

    def close(self) -> None:
        super().close()
        if self._own_state is not None:
            shutil.rmtree(self._own_state, ignore_errors=True)


def params_from_dict(d: dict) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class EngineReplica:
    """Wrapped by `replica_actor`; a threaded actor: `generate` calls run concurrently into one engine loop."""

    def __init__(self, config: ServerConfig, trainer=None, cores: tuple[int, ...] | None = None, poll_s: float = 0.2):
        self.runtime = RayRuntime(config, trainer, cores, poll_s)
        self._ids = 0
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], params: dict) -> dict:
        """Decode one prompt to the end: {"token_ids", "finish_reason", "drafter_versions", "error"}."""
        with self._lock:
            self._ids += 1
            request_id = f"r{self._ids}"
        done, out = threading.Event(), {"token_ids": [], "finish_reason": None, "drafter_versions": [], "error": None}

        def sink(event: Event) -> None:
            out["token_ids"].extend(event.token_ids)
            if event.finished:
                out["finish_reason"], out["error"] = event.finish_reason, event.error
                out["drafter_versions"] = (event.usage or {}).get("drafter_versions", [])
                done.set()

        self.runtime.loop.submit([Submission(request_id, 0, list(prompt_ids), params_from_dict(params))], sink)
        if not done.wait(GENERATE_TIMEOUT_S):
            self.runtime.loop.abort([request_id])
            out["error"] = f"no answer within {GENERATE_TIMEOUT_S:.0f} s"
        return out

    def status(self) -> dict:
        return self.runtime.status()

    def close(self) -> None:
        self.runtime.close()


def replica_actor(config: ServerConfig, trainer=None, placement=None, poll_s: float = 0.2, name: str | None = None):
    """Start one EngineReplica actor (restarted by Ray up to placement.max_restarts times; calls in flight
    when it dies fail with RayActorError and are never retried)."""
    import ray

    from tandem.cluster.specs import Placement

    placement = placement or Placement()
    options = placement.options(max_concurrency=replica_capacity(config) + 4, max_task_retries=0, **({"name": name} if name else {}))
    return ray.remote(EngineReplica).options(**options).remote(config, trainer, placement.cores, poll_s)
