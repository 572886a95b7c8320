"""tandem: online-adaptive speculative decoding.

`LLM` is imported lazily so that `import tandem.ops` (or a drafter) does not pull in the tokenizer stack.
"""
from tandem.config import EngineConfig, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from tandem import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
