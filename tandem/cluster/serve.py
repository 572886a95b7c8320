"""`tandem serve --ray`: the embedded server's app on Ray Serve (its HTTP proxy, its routing, N replicas).

Each Serve replica builds a `RayRuntime` (engine, drafter, hot-swapper, engine loop; with --online a
RayFlywheel whose trainer is one actor shared by all replicas) and serves it through the embedded server's
own ASGI app (`tandem.server.app.create_app`: the same routes, OpenAI API, SSE, keys, size limits and error
bodies). Ray Serve's proxy takes HTTP on --host/--port and routes each request to a replica.

/metrics covers every replica: each replica pushes its Prometheus text to the `MetricsHub` actor every
PUSH_S seconds, and whichever replica answers /metrics renders all of them with a `replica` label (a
replica silent for STALE_S is left out and counted in tandem:cluster_replicas_stale).

Ray Serve routes (each request to a replica with room) and replaces replicas: one whose process dies, and one
whose `check_health` raises because its engine loop is broken (every request would get 503). A replica sizes
itself from its own Ray resources (tandem.cluster.replica.replica_config), not from the whole node's. Each
deployment's names carry a deployment id (`tandem-<id>` for the Serve application, its trainer and metrics
hub): stopping one deletes its own application only, and two deployments on one cluster never share an actor.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from tandem.cluster.ray_env import connect, require_ray, shutdown, warn_if_short
from tandem.cluster.replica import RayRuntime, replica_capacity
from tandem.server.runtime import ServerConfig

PUSH_S = 1.0
STALE_S = 30.0
APP_PREFIX = "tandem"


class MetricsHub:
    """A Ray actor: the newest metrics text of every replica."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def collect(self) -> dict[str, tuple[float, str]]:
        return dict(self.texts)


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one exposition: each family's HELP/TYPE once, then every
    replica's samples with a `replica` label."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                headers = families.setdefault(family, [])
                if line not in headers:
                    headers.append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#") and family is not None:
                samples[family].append(_with_label(line, replica))
    out = []
    for family, headers in families.items():
        out.extend(headers)
        out.extend(samples[family])
    return "\n".join(out) + "\n"


def _with_label(line: str, replica: str) -> str:
    label = f'replica="{replica}"'
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and brace < space:
        inner = line[brace + 1:]
        return f"{line[:brace]}{{{label}{',' if not inner.startswith('}') else ''}{inner}"
    return f"{line[:space]}{{{label}}}{line[space:]}"


class _ClusterMetrics:
    """ASGI: /metrics from the hub (every replica); everything else to the embedded app."""

    def __init__(self, app, hub, own):
        self.app, self.hub, self.own = app, hub, own

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics" or self.hub is None:
            return await self.app(scope, receive, send)
        from starlette.responses import Response

        collected = await self.hub.collect.remote()
        now = time.time()
        fresh = {r: text for r, (at, text) in collected.items() if now - at <= STALE_S}
        fresh[self.own.replica_id] = self.own.runtime.metrics.render().decode()  # this replica: now
        stale = len(set(collected) - set(fresh))
        body = merge_metrics(fresh) + (
            "# HELP tandem:cluster_replicas Replicas reporting metrics.\n# TYPE tandem:cluster_replicas gauge\n"
            f"tandem:cluster_replicas {len(fresh)}\n"
            "# HELP tandem:cluster_replicas_stale Replicas silent for more than 30 s (left out).\n# TYPE tandem:cluster_replicas_stale gauge\n"
            f"tandem:cluster_replicas_stale {stale}\n")
        await Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")(scope, receive, send)


class TandemReplica:
    """The Serve deployment's class (wrapped by `deployment()`): a RayRuntime behind the embedded app."""

    def __init__(self, config: ServerConfig, trainer=None, hub=None, cores: tuple[int, ...] | None = None):
        from ray import serve

        self.runtime = RayRuntime(config, trainer, cores)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.hub = hub
        self._stop = threading.Event()
        if hub is not None:
            threading.Thread(target=self._push_forever, name="tandem-metrics-push", daemon=True).start()

    def __serve_build_asgi_app__(self):
        from tandem.server.app import create_app

        guard = create_app(self.runtime)  # keys and body limits apply to /metrics as to every route
        guard.app = _ClusterMetrics(guard.app, self.hub, self)
        return guard

    def _push_forever(self) -> None:
        while not self._stop.wait(PUSH_S):
            try:
                self.hub.push.remote(self.replica_id, self.runtime.metrics.render().decode())
            except Exception:  # noqa: BLE001 - the hub restarting: the next push tries again
                pass

    def check_health(self) -> None:
        check_loop_health(self.runtime.loop)

    def __del__(self):
        self._stop.set()
        self.runtime.close()


def check_loop_health(loop) -> None:
    """Serve's health check: raises unless the engine loop takes requests. A loop that is alive but broken (too many
    failed iterations in a row) answers every request 503, so Serve must replace its replica."""
    if not loop.alive:
        raise RuntimeError("the engine loop is not running")
    if loop.broken:
        raise RuntimeError(f"the engine loop is broken ({loop.consecutive_failures} failed iterations in a row): it refuses every request")


def deployment(replicas: int, num_cpus: float = 1.0, max_ongoing: int = 72):
    from ray import serve

    ingress = serve.ingress()(TandemReplica)
    return serve.deployment(ingress, name="TandemReplica", num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus},
                            max_ongoing_requests=max_ongoing, health_check_period_s=5)


@dataclass(frozen=True)
class ServeDeployment:
    """What one `tandem serve --ray` started: its Serve application and, by name, its actors."""

    app: str  # the Serve application (tandem-<id>)
    trainer: object | None  # the trainer actor's handle (--online), named app + "-trainer"
    hub: object  # the metrics hub's handle, named app + "-metrics-hub"


def start(config: ServerConfig, replicas: int, trainer_spec=None, replica_cpus: float = 1.0, address: str | None = None, num_cpus: int | None = None,
          deployment_id: str | None = None) -> ServeDeployment:
    """Join/start Ray, the trainer actor (online), the metrics hub and the Serve application `tandem-<deployment_id>`
    (default: a fresh id). Serve's HTTP proxy listens on config.host:config.port."""
    connect(address, num_cpus)  # first: an unreachable address fails in seconds, before Serve is imported
    trainer_cpus = trainer_spec.placement.num_cpus if config.online else 0.0
    warn_if_short(replicas * replica_cpus + trainer_cpus, f"tandem serve --ray ({replicas} replicas x {replica_cpus:g} CPUs + the trainer's {trainer_cpus:g})")
    import ray
    from ray import serve

    from tandem.cluster.trainer_actor import trainer_actor

    app = f"{APP_PREFIX}-{deployment_id or uuid.uuid4().hex[:8]}"
    trainer = trainer_actor(trainer_spec, name=f"{app}-trainer") if config.online else None
    hub = ray.remote(MetricsHub).options(num_cpus=0, name=f"{app}-metrics-hub", max_restarts=-1).remote()
    serve.start(http_options={"host": config.host, "port": config.port})
    bound = deployment(replicas, replica_cpus, replica_capacity(config)).bind(config, trainer, hub)
    serve.run(bound, name=app, route_prefix="/")
    return ServeDeployment(app, trainer, hub)


def stop_app(deployed: ServeDeployment) -> None:
    """Delete this deployment's Serve application (its replicas close their runtimes; other applications on the
    cluster keep running), then stop its trainer (checkpointing) and its hub."""
    import ray
    from ray import serve

    serve.delete(deployed.app)
    if deployed.trainer is not None:
        try:
            ray.get(deployed.trainer.stop.remote(), timeout=120)
        finally:
            ray.kill(deployed.trainer, no_restart=True)
    if deployed.hub is not None:
        ray.kill(deployed.hub, no_restart=True)


def _stop_partial(app: str) -> None:
    """Remove what a start interrupted part-way left of application `app`, found by its names."""
    import logging

    import ray

    def actor(name):
        try:
            return ray.get_actor(name)
        except ValueError:  # never started
            return None

    try:
        stop_app(ServeDeployment(app, actor(f"{app}-trainer"), actor(f"{app}-metrics-hub")))
    except Exception as e:  # noqa: BLE001 - Serve itself may not have started: nothing of it to delete
        logging.getLogger("tandem.server").warning("stopping the part-started application %s: %s: %s", app, type(e).__name__, e)


def serve_on_ray(config: ServerConfig, replicas: int, trainer_spec=None, replica_cpus: float = 1.0, address: str | None = None) -> None:
    """`tandem serve --ray`: run until SIGINT or SIGTERM, then delete this deployment, also one interrupted while it
    starts (and stop Ray, when this process started it). Both signals are handled here, after Ray's start-up (which
    installs a SIGTERM handler of its own that ends the process): a process started in the background inherits SIGINT
    ignored, and SIGTERM (what `kill`, systemd and Kubernetes send) would end it with its application left on the cluster."""
    import logging

    started_here = not require_ray().is_initialized()
    connect(address)
    previous = _on_signals(_interrupt)
    deployment_id = uuid.uuid4().hex[:8]
    deployed = None
    try:
        deployed = start(config, replicas, trainer_spec, replica_cpus, address, deployment_id=deployment_id)
        logging.getLogger("tandem.server").warning("serving %s on Ray Serve (application %s): %d replicas at http://%s:%d", config.model_name,
                                                   deployed.app, replicas, config.host, config.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        _on_signals(previous)  # a second signal acts as it did before: SIGTERM ends the process at once
        try:
            if deployed is not None:
                stop_app(deployed)
            else:
                _stop_partial(f"{APP_PREFIX}-{deployment_id}")
        finally:
            if started_here:  # a caller's own Ray session (tests, notebooks) stays up
                shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _on_signals(handler) -> dict:
    """Install `handler` (one callable, or {signal: handler} as returned here) for SIGINT and SIGTERM; returns the
    handlers it replaced. Off the main thread (where Python refuses handlers) it does nothing."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = handler if isinstance(handler, dict) else {signal.SIGINT: handler, signal.SIGTERM: handler}
    return {sig: signal.signal(sig, h) for sig, h in handlers.items()}
