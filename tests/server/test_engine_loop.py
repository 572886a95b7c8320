"""The engine loop without HTTP: admission budget per step, all-or-nothing choices, aborts, shutdown."""
import threading
import time

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.server.engine_loop import EngineLoop, QueueFullError, Submission

from tiny_helpers import load_packed, make_prompts, plain_outputs

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Sink:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finished:
            self.done.set()

    def tokens(self, index=0):
        return [t for e in self.events if e.index == index for t in e.token_ids]


def run_three(target, budget):
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=64))
    prefill_steps = []
    engine.observers.append(lambda record: record.kind == "prefill" and prefill_steps.append(record.step))
    loop = EngineLoop(engine, max_queue=0, prefill_tokens_per_step=budget).start()
    prompts = make_prompts(3, seed=2)
    sink = Sink()
    loop.submit([Submission(f"r{i}", i, prompt, GREEDY) for i, prompt in enumerate(prompts)], sink)  # one burst
    deadline = time.monotonic() + 30
    while loop.held and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert [sink.tokens(i) for i in range(3)] == plain_outputs(target, prompts, [GREEDY] * 3)
    assert loop.held == 0 and not engine.running
    return prefill_steps


def test_the_prefill_budget_spreads_a_burst_over_steps(tiny_llama):
    target = load_packed(tiny_llama)
    assert len(set(run_three(target, budget=1))) == 3  # one admission per step
    assert len(set(run_three(target, budget=10_000))) == 1  # the whole burst in one step


def test_capacity_and_abort_of_a_queued_request(tiny_llama):
    target = load_packed(tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=1, max_model_len=64))
    engine.between_steps.append(lambda e: time.sleep(0.005))
    loop = EngineLoop(engine, max_queue=1).start()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running, queued = Sink(), Sink()
    loop.submit([Submission("a", 0, [1, 2, 3], long)], running)
    loop.submit([Submission("b", 0, [4, 5, 6], long)], queued)  # waits in the backlog: the batch has one row
    try:
        loop.submit([Submission("c", 0, [7], long)], Sink())
        raise AssertionError("over capacity was accepted")
    except QueueFullError:
        pass
    loop.abort(["b"])
    assert queued.done.wait(10) and queued.events[-1].finish_reason == "abort" and queued.tokens() == []
    loop.abort(["a"])
    assert running.done.wait(10) and running.events[-1].finish_reason == "abort" and running.events[-1].usage["output_tokens"] < 40
    deadline = time.monotonic() + 5
    while loop.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.held == 0 and not engine.running and not engine.waiting
    loop.stop()
    assert not loop.alive
