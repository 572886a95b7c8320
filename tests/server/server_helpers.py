"""A real uvicorn server on a free loopback port, in a thread of the test process (tests reach its Runtime)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tandem.server.app import create_app
from tandem.server.runtime import Runtime, ServerConfig

MODEL = "tiny"


def tiny_config(model_dir: str, **overrides) -> ServerConfig:
    base = dict(model=model_dir, served_model_name=MODEL, max_batch_size=4, max_queue=64, max_model_len=128, threads=1)
    return ServerConfig(**(base | overrides))


class LiveServer:
    def __init__(self, config: ServerConfig):
        self.runtime = Runtime(config)
        self.app = create_app(self.runtime)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
        self.runtime.close()

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
