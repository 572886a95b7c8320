import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_helpers import LiveServer, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_llama):
    """An eagle-drafting server over the tiny llama (day-0 head: speculation runs, acceptance is low)."""
    with LiveServer(tiny_config(tiny_llama, drafter="eagle", draft_vocab_size=200)) as live:
        yield live


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Plain decoding through the library entry point (what every greedy server response must equal)."""
    from tandem.llm import LLM

    return LLM(tiny_llama, max_model_len=128, num_threads=1)
