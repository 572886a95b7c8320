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
