"""Environment variables for child processes: spawn copies the parent's environment when the child starts."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def child_environment(**variables: str):
    """Environment variables for a process started in the block, the parent's restored after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.update({name: value for name, value in saved.items() if value is not None})
        for name in [name for name, value in saved.items() if value is None]:
            del os.environ[name]


def peer_environment() -> dict[str, str]:
    """The environment a peer engine's process runs in (llama.cpp's tools, onnxruntime-genai's worker): ours, less the
    OpenMP wait policy `import tandem` chose for itself on a busy machine, so a peer waits as its own users run it
    (llama.cpp's OpenMP build inherited tandem's PASSIVE and ran 18.5 tok/s where its default ran 27.8: BENCHMARKS 12).
    A policy the user set stays, for both sides."""
    import tandem

    env = dict(os.environ)
    if tandem._policy is not None and env.get("OMP_WAIT_POLICY") == tandem._policy:
        del env["OMP_WAIT_POLICY"]
    return env
