"""tandem: online-adaptive speculative decoding.

`LLM` is imported lazily so that `import tandem.ops` (or a drafter) does not pull in the tokenizer stack.
"""
import os

QUIET_LOAD = 0.5  # a 1-minute load average below this: nothing else runs here, and OpenMP's workers may spin


def wait_policy(environ, load: float) -> str | None:
    """The OpenMP wait policy for this process, or None to keep OpenMP's default (libgomp: a worker spins ~300k
    iterations for the next parallel region, then sleeps). Measured on a 2-vCPU Zen 5 (docs/BENCHMARKS.md 12), a
    decode step from the main thread, 2 threads: on an idle box the spinning default takes 10.2 ms at batch 1 and
    23.5 at 16 where PASSIVE (a futex wake per parallel region) takes 18.4-20.0 and 36.4 (1.8x, 1.55x); beside one
    busy process of the same priority spinning takes 40-88 ms and PASSIVE 21-23. So: the user's choice where they made
    one (OMP_WAIT_POLICY or GOMP_SPINCOUNT), OpenMP's spinning default on a quiet machine, PASSIVE where anything else
    runs. The load is read once, when tandem is imported (the policy is read when torch loads OpenMP)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    return None if load < QUIET_LOAD else "PASSIVE"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this platform: assume a busy machine
        return float("inf")


_policy = wait_policy(os.environ, _load())
if _policy is not None:
    os.environ["OMP_WAIT_POLICY"] = _policy

from tandem.config import EngineConfig, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from tandem import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
