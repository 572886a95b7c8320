"""The server of `tandem bench soak`: `tandem serve`'s composition plus two injected faults, in a child process.

    python -m tandem.bench.serving.soak_server SPEC.json

SPEC holds {"server": ServerConfig fields, "prefill_marker": [ids], "step_marker": [ids], "fault_log": path}.
The faults go through the engine's public extension points, as anyone's own wrapper would:

- a failing prefill: `engine.model` (the forward the engine calls for prefills; the decode path is compiled from it
  at start) is wrapped by `FailingPrefill`, which raises once for a prompt holding `prefill_marker`: the engine
  fails that request alone;
- a failing step: a hook in `engine.between_steps` (where the drafter hot-swap also hooks) raises once when a
  running request's prompt holds `step_marker`: the whole step fails, so every request it was running or
  prefilling is failed.

Each fault appends a JSON line {"fault", "request_ids"} (the engine's request ids, `<response id>-<choice>`) to
`fault_log`, so the soak can tell the injected faults' own requests from any other server error.
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path


def holds(ids: list[int], marker: list[int]) -> bool:
    n = len(marker)
    return n > 0 and any(ids[i:i + n] == marker for i in range(len(ids) - n + 1))


class FaultLog:
    def __init__(self, path: Path):
        self.path, self._lock = Path(path), threading.Lock()

    def write(self, fault: str, request_ids: list[str]) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps({"fault": fault, "request_ids": request_ids}) + "\n")


class FailingPrefill:
    """The target model, except that the first prefill forward over `marker` raises."""

    def __init__(self, model, marker: list[int], log: FaultLog, engine):
        self.model, self.marker, self.log, self.engine, self.fired = model, list(marker), log, engine, False

    def __call__(self, ids, *args, **kwargs):
        if not self.fired and kwargs.get("last_only") and holds(ids[0].tolist(), self.marker):
            self.fired = True
            engine = self.engine  # the request being prefilled: read alone (chunks) or whole
            request = next((r for r in [engine.prefilling, *engine.running] if r is not None and holds(r.prompt_ids, self.marker)), None)
            self.log.write("prefill", [request.request_id] if request is not None else [])
            raise RuntimeError("injected prefill fault (tandem bench soak)")
        return self.model(ids, *args, **kwargs)

    def forward_packed(self, prompts, *args, **kwargs):
        """Prompts prefilled together: one holding the marker fails the packed forward, and the engine then prefills
        them one at a time, where `__call__` fails that one alone."""
        if not self.fired and any(holds(list(p), self.marker) for p in prompts):
            raise RuntimeError("injected prefill fault (tandem bench soak), packed forward")
        return self.model.forward_packed(prompts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class FailingStep:
    """A between-steps hook that fails the first step whose batch runs a request holding `marker`."""

    def __init__(self, marker: list[int], log: FaultLog):
        self.marker, self.log, self.fired = list(marker), log, False

    def __call__(self, engine) -> None:
        if self.fired or not any(holds(r.prompt_ids, self.marker) for r in engine.running):
            return
        self.fired = True
        failing = [*engine.running, *([engine.prefilling] if engine.prefilling is not None else [])]
        self.log.write("step", [r.request_id for r in failing])
        raise RuntimeError("injected step fault (tandem bench soak)")


def install_faults(engine, prefill_marker: list[int], step_marker: list[int], log_path: Path) -> None:
    log = FaultLog(log_path)
    engine.model = FailingPrefill(engine.model, prefill_marker, log, engine)
    engine.between_steps.append(FailingStep(step_marker, log))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from tandem.server.app import create_app, draining_server
    from tandem.server.logs import configure
    from tandem.server.runtime import Runtime, ServerConfig

    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    config = ServerConfig(**spec["server"])
    configure("warning", False)
    runtime = Runtime(config)
    install_faults(runtime.engine, spec["prefill_marker"], spec["step_marker"], Path(spec["fault_log"]))
    try:
        uv = uvicorn.Config(create_app(runtime), host=config.host, port=config.port, log_level="warning",
                            timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)))
        draining_server(runtime, uv).run()
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
