"""A real uvicorn server on a free loopback port, in a thread of the test process (tests reach its Runtime)."""
from __future__ import annotations

from tandem.server.background import BackgroundServer
from tandem.server.runtime import Runtime, ServerConfig

MODEL = "tiny"


def tiny_config(model_dir: str, **overrides) -> ServerConfig:
    base = dict(model=model_dir, served_model_name=MODEL, max_batch_size=4, max_queue=64, max_model_len=128, threads=1)
    return ServerConfig(**(base | overrides))


class LiveServer(BackgroundServer):
    def __init__(self, config: ServerConfig):
        super().__init__(Runtime(config))
