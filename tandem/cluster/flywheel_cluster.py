"""The flywheel on Ray, driven from one process: N engine replicas and one trainer actor.

    cluster = FlywheelCluster(server_config, replicas=2, trainer=TrainerSpec(...)).start()
    results = cluster.generate(prompts, params)      # spread over the replicas; each answer says which served it
    cluster.versions()                               # the drafter version each replica serves
    cluster.close()

Traces flow replica -> trainer actor; versions flow trainer -> object store (one `ray.put` per version) ->
every replica (each polls and fetches the same object). Replicas and trainer declare `num_cpus` (Ray places
them on any node with room) and may be pinned to cores (`Placement.cores`). A replica or trainer whose
process dies is restarted by Ray; a request a dead replica was serving fails with `ReplicaFailed` (never
hangs, never retried: sampling with a seed would be safe to retry, but a client may already hold tokens).

Why this routes by hand (round-robin, or `replica=` given) while `tandem serve --ray` leaves routing and replacing
replicas to Ray Serve: this class is the harness of the cluster tests and benchmarks, which must know which
replica served each request and send work to one chosen replica (compare a replica's output with plain decoding
after it swapped, kill the replica that holds the requests, time one replica against another). Serve's router
picks a replica by queue length and hides which one it picked. What users run is the Serve path; its replica
kill and health replacement are tested through `tandem serve --ray` (tests/cluster/scenarios.py `serve_cli`).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

from tandem.cluster.replica import GENERATE_TIMEOUT_S, replica_actor, replica_capacity
from tandem.cluster.specs import Placement, TrainerSpec
from tandem.cluster.trainer_actor import trainer_actor
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError, TandemError
from tandem.server.runtime import ServerConfig

READY_TIMEOUT_S = 300.0


class ReplicaFailed(TandemError):
    """The replica serving a request died (or stopped answering) before the request finished."""


class FlywheelCluster:
    def __init__(self, config: ServerConfig, replicas: int = 2, trainer: TrainerSpec | None = None, replica_placement: Placement = Placement(),
                 replica_cores: list[tuple[int, ...] | None] | None = None, poll_s: float = 0.2):
        if replicas < 1:
            raise InvalidParameterError(f"replicas must be >= 1, got {replicas}")
        if config.online and trainer is None:
            raise InvalidParameterError("an online cluster needs a TrainerSpec (the trainer actor)")
        if replica_cores is not None and len(replica_cores) != replicas:
            raise InvalidParameterError(f"replica_cores needs one entry per replica ({replicas}), got {len(replica_cores)}")
        self.config, self.n, self.trainer_spec = config, replicas, trainer
        self.placement, self.replica_cores, self.poll_s = replica_placement, replica_cores, poll_s
        self.trainer = None
        self.replicas: list = []
        self._next = itertools.count()
        self._pool = ThreadPoolExecutor(max(4, replicas * replica_capacity(config)), thread_name_prefix="tandem-cluster")

    def start(self) -> "FlywheelCluster":
        import ray

        if self.config.online:
            self.trainer = trainer_actor(self.trainer_spec)
        for i in range(self.n):
            cores = self.replica_cores[i] if self.replica_cores else self.placement.cores
            self.replicas.append(replica_actor(self.config, self.trainer, dataclasses.replace(self.placement, cores=cores), self.poll_s))
        waits = [r.status.remote() for r in self.replicas] + ([self.trainer.status.remote()] if self.trainer is not None else [])
        ray.get(waits, timeout=READY_TIMEOUT_S)
        return self

    # ---- serving -------------------------------------------------------------------------------------------
    def generate_on(self, replica: int, prompt_ids: list[int], params: SamplingParams, timeout: float = GENERATE_TIMEOUT_S) -> dict:
        """One request on one replica; ReplicaFailed when that replica dies or stops answering."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        ref = self.replicas[replica].generate.remote(list(prompt_ids), dataclasses.asdict(params))
        try:
            out = ray.get(ref, timeout=timeout)
        except ActorUnavailableError as e:  # before RayActorError: its subclass
            raise ReplicaFailed(f"replica {replica} is unavailable (died, restarting); the request did not finish, retry on any replica ({type(e).__name__})") from e
        except RayActorError as e:
            raise ReplicaFailed(f"replica {replica} died while serving this request; the request did not finish, retry on any replica ({type(e).__name__})") from e
        except GetTimeoutError as e:
            ray.cancel(ref)
            raise ReplicaFailed(f"replica {replica} gave no answer within {timeout:.0f} s") from e
        if out["error"]:
            raise ReplicaFailed(f"replica {replica}: {out['error']}")
        return out | {"replica": replica}

    def submit(self, prompt_ids: list[int], params: SamplingParams, replica: int | None = None):
        """A future of generate_on (round-robin over replicas unless `replica` is given)."""
        index = next(self._next) % self.n if replica is None else replica
        return self._pool.submit(self.generate_on, index, prompt_ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        futures = [self.submit(p, q) for p, q in zip(prompts, params)]
        return [f.result() for f in futures]

    # ---- watching ------------------------------------------------------------------------------------------
    def status(self, timeout: float = 30.0) -> list[dict | None]:
        """Each replica's status (None for one that does not answer: dead or restarting)."""
        import ray

        out = []
        for r in self.replicas:
            try:
                out.append(ray.get(r.status.remote(), timeout=timeout))
            except Exception:  # noqa: BLE001 - dead or restarting
                out.append(None)
        return out

    def versions(self) -> list[int | None]:
        return [None if s is None else s["version"] for s in self.status()]

    def trainer_status(self, timeout: float = 30.0) -> dict | None:
        import ray

        try:
            return ray.get(self.trainer.status.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001
            return None

    def wait_until(self, predicate, timeout: float, poll_s: float = 0.25) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(poll_s)
        return predicate()

    def close(self) -> None:
        import ray

        for r in self.replicas:
            try:
                ray.get(r.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - already dead
                pass
            ray.kill(r, no_restart=True)
        if self.trainer is not None:
            try:
                ray.get(self.trainer.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(self.trainer, no_restart=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "FlywheelCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
