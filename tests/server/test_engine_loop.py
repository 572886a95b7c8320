"""The engine loop without HTTP: admission budget per step, all-or-nothing choices, aborts, shutdown."""
import threading
import time

import pytest

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.server.engine_loop import EngineLoop, LoopStoppedError, QueueFullError, Submission

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


POISON = 7  # a prompt holding this token raises in its prefill forward


class PoisonedPrefill:
    """The target, except that a prefill forward (last_only) over the poison token raises: a fault in one request."""

    def __init__(self, model):
        self.model, self.raised = model, 0

    def __call__(self, ids, *args, **kwargs):
        if kwargs.get("last_only") and POISON in ids.tolist()[0]:
            self.raised += 1
            raise RuntimeError("injected prefill fault")
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def wait_idle(loop, timeout=30):
    deadline = time.monotonic() + timeout
    while loop.held and time.monotonic() < deadline:
        time.sleep(0.01)
    return loop.held == 0


def test_a_prefill_that_raises_fails_its_request_and_not_the_loop(tiny_llama):
    target = load_packed(tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=3, max_model_len=64, prefill_chunk_tokens=512))
    engine.between_steps.append(lambda e: time.sleep(0.005))
    poisoned = engine.model = PoisonedPrefill(target)
    loop = EngineLoop(engine, max_queue=4).start()
    bad, good, running = Sink(), Sink(), Sink()
    prompt, first = make_prompts(2, seed=3)
    loop.submit([Submission("running", 0, first, GREEDY)], running)  # decoding when the bad prefill raises: unharmed
    deadline = time.monotonic() + 10
    while not running.events and time.monotonic() < deadline:
        time.sleep(0.005)
    loop.submit([Submission("bad", 0, [1, 2, POISON, 3], GREEDY)], bad)
    loop.submit([Submission("good", 0, prompt, GREEDY)], good)
    assert bad.done.wait(10), "the client of the failing prefill was never answered"
    assert good.done.wait(30), "a request behind the failing prefill never ran"
    assert bad.events[-1].error_code == "engine_step_failed" and "injected prefill fault" in bad.events[-1].error
    assert good.tokens() == plain_outputs(target, [prompt], [GREEDY])[0] and good.events[-1].finish_reason == "length"
    assert running.done.wait(30) and running.tokens() == plain_outputs(target, [first], [GREEDY])[0]
    assert poisoned.raised == 1 and loop.prefills_failed == 1 and loop.steps_failed == 0  # failed once, alone, not retried every step
    assert wait_idle(loop) and engine.prefilling is None and not engine.running and not engine.waiting
    loop.stop()


def fault_once(obj, name, times=1):
    """Make obj.name raise the next `times` calls (a bug in that part of the loop), then behave again."""
    original, left = getattr(obj, name), [times]

    def faulty(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, faulty)


@pytest.mark.parametrize("where", ["abort", "admit", "deliver"])
def test_a_fault_outside_the_step_fails_the_requests_in_flight_and_the_loop_carries_on(tiny_llama, where):
    target = load_packed(tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=2, max_model_len=64))
    engine.between_steps.append(lambda e: time.sleep(0.005))
    loop = EngineLoop(engine, max_queue=4).start()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = Sink()
    if where == "admit":
        fault_once(loop, "_admit")
    loop.submit([Submission("a", 0, [1, 2, 3], long)], first)
    if where == "abort":
        deadline = time.monotonic() + 10
        while not first.events and time.monotonic() < deadline:
            time.sleep(0.005)
        fault_once(engine, "abort")
        loop.abort(["a"])
    if where == "deliver":
        fault_once(loop, "_deliver")
    assert first.done.wait(10), f"a fault in {where} left the client waiting forever"
    assert first.events[-1].error_code == "engine_loop_failed" and f"injected fault in" in first.events[-1].error
    assert loop.alive and loop.iterations_failed == 1 and not loop.broken
    assert wait_idle(loop) and not engine.has_unfinished()
    second = Sink()
    prompt = make_prompts(1, seed=4)[0]
    loop.submit([Submission("b", 0, prompt, GREEDY)], second)
    assert second.done.wait(30) and second.tokens() == plain_outputs(target, [prompt], [GREEDY])[0]
    loop.stop()


def test_a_loop_that_keeps_failing_is_broken_and_refuses_new_requests(tiny_llama):
    target = load_packed(tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=2, max_model_len=64))
    loop = EngineLoop(engine, max_queue=4, max_consecutive_failures=3).start()
    fault_once(loop, "_admit", times=1000)
    sinks = [Sink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        loop.submit([Submission(f"r{i}", 0, [1, 2, 3], GREEDY)], sink)
    assert all(s.done.wait(10) and s.events[-1].error_code == "engine_loop_failed" for s in sinks)
    deadline = time.monotonic() + 10
    while not loop.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.broken and loop.alive and not loop.healthy
    with pytest.raises(LoopStoppedError, match="refuses new requests"):
        loop.submit([Submission("late", 0, [1, 2, 3], GREEDY)], Sink())
    loop.stop()


def test_a_request_queued_past_the_queue_timeout_is_failed(tiny_llama):
    target = load_packed(tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=1, max_model_len=64))
    engine.between_steps.append(lambda e: time.sleep(0.01))
    loop = EngineLoop(engine, max_queue=2, queue_timeout_s=0.3).start()
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    running, queued = Sink(), Sink()
    loop.submit([Submission("a", 0, [1, 2, 3], long)], running)
    loop.submit([Submission("b", 0, [4, 5, 6], long)], queued)  # one row: waits behind "a" (50 steps of >= 10 ms)
    assert queued.done.wait(10) and queued.events[-1].error_code == "queue_timeout" and queued.tokens() == []
    assert running.done.wait(30) and running.events[-1].finish_reason == "length" and len(running.tokens()) == 50
    assert loop.queue_timeouts == 1 and wait_idle(loop)
    loop.stop()
