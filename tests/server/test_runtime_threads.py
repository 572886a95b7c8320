"""The served model is built on a thread that ends before the engine loop starts: the OpenMP team a thread starts lives
until that thread ends, and a second team beside the loop's made libgomp stop spinning (docs/BENCHMARKS.md 12)."""
import threading

import pytest

from server_helpers import tiny_config
from tandem.errors import UnknownModelError
from tandem.server.runtime import Runtime


def test_the_model_is_built_on_a_thread_that_has_ended_when_the_loop_starts(tiny_llama, monkeypatch):
    import tandem.llm

    built_on = []
    original = tandem.llm.LLM.__init__

    def recording_init(self, *args, **kwargs):
        built_on.append(threading.current_thread())
        original(self, *args, **kwargs)

    monkeypatch.setattr(tandem.llm.LLM, "__init__", recording_init)
    runtime = Runtime(tiny_config(tiny_llama))
    try:
        [thread] = built_on
        assert thread is not threading.main_thread() and thread.name == "tandem-build"
        assert not thread.is_alive()  # its OpenMP team, if it started one, is gone
        assert runtime.loop.alive and runtime.loop._thread is not thread
    finally:
        runtime.close()


def test_a_model_that_cannot_be_built_raises_on_the_callers_thread(tmp_path):
    """The build thread's error, unchanged (the CLI prints a TandemError as `error: ...`)."""
    with pytest.raises(UnknownModelError, match="is neither a zoo model nor a local directory"):
        Runtime(tiny_config(str(tmp_path / "no-such-model")))
