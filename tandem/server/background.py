"""A uvicorn server in a background thread on a loopback port (benchmarks, tests, notebooks)."""
from __future__ import annotations

import socket
import threading
import time

from tandem.errors import TandemError


class BackgroundServer:
    """Serve `runtime` over HTTP from a daemon thread; `close()` stops uvicorn, then the runtime."""

    def __init__(self, runtime, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0):
        import uvicorn

        from tandem.server.app import create_app

        self.runtime = runtime
        self.app = create_app(runtime)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # port 0: a free port, chosen without a race
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        from tandem.server.app import draining_server

        self._server = draining_server(runtime, uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="tandem-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.close()
                raise TandemError("the HTTP server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
        self.runtime.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
