"""tandem: online-adaptive speculative decoding.

`LLM` is imported lazily so that `import tandem.ops` (or a drafter) does not pull in the tokenizer stack.
"""
import os

# OpenMP's worker threads spin between parallel regions by default. Measured on a 2-vCPU box with other work on it:
# a decode step from the main thread took 0.5-1.2 s spinning against 34 ms passive (docs/BENCHMARKS.md 12). Passive
# waiting unless the user chose a policy; it must be set before torch loads its OpenMP runtime (import tandem first).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tandem.config import EngineConfig, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from tandem import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
