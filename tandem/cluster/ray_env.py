"""Joining or starting a Ray cluster, with clear errors, and pinning a process to cores.

Ray is an optional dependency (`pip install 'tandem[ray]'`): `require_ray()` imports it or says how to
install it. `connect(address)` joins an existing cluster ("HOST:PORT", or "auto" for the one `ray start`
began on this node) after checking, within seconds, that something listens there (Ray's own connect
retries for about a minute before failing); without an address it starts a local cluster with
`num_cpus` and no dashboard. `pin_to_cores` is the CPU-affinity half of "engine on one core, trainer
on the other": Ray's `num_cpus` only reserves capacity, it does not bind a process to a core.
"""
from __future__ import annotations

import os
import socket

from tandem.errors import InvalidParameterError, TandemError

CONNECT_PROBE_S = 3.0


class RayUnavailableError(TandemError):
    """Ray is not installed, or the cluster address cannot be reached."""


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise RayUnavailableError("the Ray path needs Ray: pip install 'tandem[ray]' (ray[serve]==2.60.0)") from e
    return ray


def _probe(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidParameterError(f"--address must be HOST:PORT (the head's GCS address, e.g. 10.0.0.1:6379) or 'auto', got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_PROBE_S):
            pass
    except OSError as e:
        raise RayUnavailableError(f"cannot reach the Ray cluster at {address}: {e} (is `ray start --head` running there, and the port open?)") from e


def connect(address: str | None = None, num_cpus: int | None = None, namespace: str = "tandem", worker_niceness: int | None = None):
    """ray.init: join `address` (checked first) or start a local cluster; returns the ray module.

    A local cluster runs its workers `worker_niceness` above this process (None: Ray's default, 15). Benchmarks
    that time an actor against this process pass 0: on a shared machine a worker 15 steps nicer loses the CPU
    to everything else and its arm measures the neighbours, not Ray."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    if address is not None and address != "auto":
        _probe(address.removeprefix("ray://"))
    kwargs = {"namespace": namespace, "log_to_driver": False}
    try:
        if address is None:
            system = {} if worker_niceness is None else {"_system_config": {"worker_niceness": worker_niceness}}
            ray.init(num_cpus=num_cpus, include_dashboard=False, **system, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except ConnectionError as e:
        raise RayUnavailableError(f"cannot join the Ray cluster at {address}: {e}") from e
    return ray


def shutdown() -> None:
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        ray.shutdown()


def warn_if_short(asked_cpus: float, what: str) -> float:
    """Log a warning when the cluster has fewer CPUs than `what` asks for (Ray would hold the actors that do not fit
    as pending, and the command would wait without a word); returns the cluster's CPUs. A warning, not an error: an
    autoscaling cluster grows to fit."""
    import logging

    total = float(require_ray().cluster_resources().get("CPU", 0.0))
    message = shortfall(asked_cpus, total, what)
    if message is not None:
        logging.getLogger("tandem.cluster").warning("%s", message)
    return total


def shortfall(asked_cpus: float, total_cpus: float, what: str) -> str | None:
    if asked_cpus <= total_cpus:
        return None
    return (f"{what} asks Ray for {asked_cpus:g} CPUs and the cluster has {total_cpus:g}: the actors that do not fit wait until it grows "
            "(lower the --*-cpus options, or add nodes)")


def pin_to_cores(cores: tuple[int, ...] | None) -> tuple[int, ...]:
    """Bind this process (all its threads created later) to `cores`; None leaves it as it is. Returns the
    affinity now in force."""
    if cores:
        available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
        if not set(cores) <= available:
            raise InvalidParameterError(f"cores {sorted(cores)} not all on this machine (it has {sorted(available)})")
        os.sched_setaffinity(0, set(cores))
    return tuple(sorted(os.sched_getaffinity(0)))
