"""One thread owns the engine; HTTP handlers talk to it through a thread-safe inbox and per-request sinks.

Requests join (`submit`) and leave (`abort`) between steps only: the loop drains the inbox, admits
requests from its backlog into free batch rows within a prompt-token budget per step (so one step does
not prefill a whole burst while the running requests and the first arrivals wait for all of it), runs
one step (`engine.step` or `flywheel.step`), and hands each request's new tokens to its sink. Sinks are
called on the engine thread and must not block (the server's sinks do `loop.call_soon_threadsafe`).
An exception inside a step fails the requests that step was running or prefilling (their sinks get an
error event, their cache rows are freed) and the loop carries on with the next step. Anything else that
raises in an iteration (admission, abort, delivery, a metrics hook) is caught by an outer guard: every
request in flight is failed with a clear error, and the loop carries on; after `max_consecutive_failures`
failed iterations in a row the loop is `broken` (readiness and liveness go false, new requests get 503),
so no client ever waits forever. Requests that wait in the backlog longer than `queue_timeout_s` are
failed with code "queue_timeout". Errors are logged at most once per 10 s per kind.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.config import SamplingParams
from tandem.engine.prompt_logprobs import prompt_logprobs
from tandem.errors import TandemError
from tandem.server.logs import RateLimitedLog

log = logging.getLogger("tandem.server")
errors = RateLimitedLog(log)


class QueueFullError(TandemError):
    """The server holds as many requests as it may (running + queued): retry later."""


class LoopStoppedError(TandemError):
    """The engine loop is not running."""


@dataclass
class Event:
    """What a sink receives: new tokens of one choice; at the end, its finish reason and usage."""

    index: int  # the choice this event belongs to
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: dict | None = None  # at finish: the request's metrics + drafter versions
    error: str | None = None  # the step serving this request failed; the request is over
    error_code: str | None = None  # with error: engine_step_failed | engine_loop_failed | queue_timeout | request_rejected | shutting_down
    logprobs: list[float] | None = None  # params.logprobs: each new token's log-prob under the target (untempered)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # params.top_logprobs: each new token's most likely (token, log-prob)
    prompt_logprobs: list[tuple[int, float | None, list | None]] | None = None  # Submission.prompt_logprobs: before any token


@dataclass
class Submission:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    submitted: float = field(default_factory=time.perf_counter)  # the clock of RequestMetrics (queue time)
    prompt_logprobs: int | None = None  # alternatives per prompt token: the prompt's log-probs are sent before its tokens


@dataclass
class _Entry:
    sink: Callable[[Event], None]
    index: int
    request: object  # the engine's Request (metrics, output ids)
    submitted: float = 0.0  # perf_counter when the handler submitted it
    versions: set[int] = field(default_factory=set)
    delivered: int = 0  # output tokens handed to the sink so far
    last_delivery: float | None = None  # perf_counter of the last event with tokens (inter-token latency)


class EngineLoop:
    def __init__(self, engine, step: Callable[[], list] | None = None, max_queue: int = 64, on_finish: Callable[[dict], None] | None = None,
                 prefill_tokens_per_step: int = 512, queue_timeout_s: float | None = None, max_consecutive_failures: int = 8):
        self.engine = engine
        self.queue_timeout_s = queue_timeout_s  # backlog wait before a request is failed ("queue_timeout"); None = forever
        self.max_consecutive_failures = max_consecutive_failures
        self.on_tokens: Callable[[float], None] | None = None  # engine thread: inter-token latency of each later delivery
        self.step = step or engine.step
        self.prefill_tokens_per_step = prefill_tokens_per_step  # admission budget; one request is always admitted
        self.capacity = engine.config.max_batch_size + max_queue  # requests held at once (running + waiting)
        self.on_finish = on_finish  # called on the engine thread with each finished request's usage
        self.steps_failed = 0  # steps that raised (their requests were failed)
        self.prefills_failed = 0  # requests whose prefill raised (the engine failed them alone)
        self.iterations_failed = 0  # loop iterations that raised outside a step (every request in flight was failed)
        self.consecutive_failures = 0
        self.broken = False  # too many failed iterations in a row: the loop refuses new work
        self.queue_timeouts = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}  # engine thread only: requests in the engine
        self._backlog: deque[tuple[Submission, Callable[[Event], None]]] = deque()  # engine thread only: not yet admitted
        self._held = 0  # requests submitted and not yet finished (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- any thread ------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.alive and not self.broken and not self._stop.is_set()

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    @property
    def held(self) -> int:
        return self._held

    def submit(self, submissions: list[Submission], sink: Callable[[Event], None]) -> None:
        """Queue all submissions (one per choice) or none: QueueFullError when they do not fit."""
        if not self.healthy:
            raise LoopStoppedError("the engine loop is not running" if not self.broken else
                                   f"the engine loop failed {self.consecutive_failures} times in a row and refuses new requests")
        with self._lock:
            if self._held + len(submissions) > self.capacity:
                raise QueueFullError(f"the server is at capacity ({self.capacity} requests running or queued); retry later")
            self._held += len(submissions)
        self._inbox.put(("add", submissions, sink))

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(("abort", request_ids, None))

    def _release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    # ---- the engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
                self.consecutive_failures = 0
            except Exception as e:  # noqa: BLE001 - the outer guard: fail what is in flight, never leave a client waiting
                self._iteration_failed(e)
        self._fail_all("the server is shutting down", "shutting_down")

    def _iterate(self) -> None:
        self._drain(block=not (self.engine.has_unfinished() or self._backlog))
        self._expire()
        self._admit()
        if not self.engine.has_unfinished():
            return
        try:
            outputs = self.step()
        except Exception as e:  # noqa: BLE001 - any fault fails this step's requests, never the loop
            self._fail_running(e)
            return
        version = self._version()
        now = time.perf_counter()
        for out in outputs:
            self._deliver(out, version, now)

    def _iteration_failed(self, error: Exception) -> None:
        self.iterations_failed += 1
        self.consecutive_failures += 1
        errors.exception(f"loop:{type(error).__name__}", "engine loop iteration failed (%s: %s); failing every request in flight",
                         type(error).__name__, error, exc_info=error)
        message = f"the server failed while serving this request ({type(error).__name__}: {error}); the request was aborted"
        try:
            self._fail_all(message, "engine_loop_failed")
            for request in [*self.engine.waiting, *self.engine.running, self.engine.prefilling]:
                if request is not None:
                    self.engine.abort(request.request_id)
        except Exception as again:  # noqa: BLE001 - the engine cannot even abort: stop taking work
            errors.exception("loop:cleanup", "cleaning up after a failed iteration raised (%s)", again, exc_info=again)
            self.broken = True
        if self.consecutive_failures >= self.max_consecutive_failures:
            self.broken = True
        if self.broken:
            self._fail_all(message, "engine_loop_failed")
            time.sleep(0.05)  # a broken loop still answers (fails) whatever is queued, without spinning

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload, sink) -> None:
        if kind == "add":
            self._queue_all(payload, sink)
        elif kind == "abort":
            for request_id in payload:
                self._abort(request_id)

    def _queue_all(self, subs: list[Submission], sink) -> None:
        """Into the backlog, all choices or none (each is validated as the engine will)."""
        for sub in subs:
            try:
                self.engine.validate(sub.prompt_ids, sub.params)
            except Exception as e:  # noqa: BLE001 - a request the handler's checks missed; tell its client
                self._release(len(subs))
                for other in subs:
                    _send(sink, Event(other.index, [], True, "error", error=f"request rejected: {e}", error_code="request_rejected"))
                return
        if self.broken:
            self._release(len(subs))
            for sub in subs:
                _send(sink, Event(sub.index, [], True, "error", error="the engine loop is broken", error_code="engine_loop_failed"))
            return
        self._backlog.extend((sub, sink) for sub in subs)

    def _expire(self) -> None:
        """Fail backlog requests that waited longer than queue_timeout_s (oldest first: the backlog is FIFO)."""
        if self.queue_timeout_s is None:
            return
        deadline = time.perf_counter() - self.queue_timeout_s
        while self._backlog and self._backlog[0][0].submitted < deadline:
            sub, sink = self._backlog.popleft()
            self._release(1)
            self.queue_timeouts += 1
            _send(sink, Event(sub.index, [], True, "error", error=f"the request waited more than {self.queue_timeout_s:g} s in the queue; "
                              "the server is overloaded, retry later", error_code="queue_timeout"))

    def _admit(self) -> None:
        """Move backlog requests into free batch rows, up to the prompt-token budget of one step."""
        engine, budget, admitted = self.engine, self.prefill_tokens_per_step, 0
        while self._backlog and engine.in_flight() < engine.config.max_batch_size:
            sub, sink = self._backlog[0]
            if admitted and len(sub.prompt_ids) > budget:
                return
            self._backlog.popleft()
            if sub.prompt_logprobs is not None and not self._send_prompt_logprobs(sub, sink):
                continue
            try:
                engine.add_request(sub.prompt_ids, sub.params, request_id=sub.request_id)
            except Exception as e:  # noqa: BLE001 - validated when queued; never let one request stop the loop
                self._release(1)
                _send(sink, Event(sub.index, [], True, "error", error=f"request rejected: {e}", error_code="request_rejected"))
                continue
            self._entries[sub.request_id] = _Entry(sink, sub.index, engine.waiting[-1], sub.submitted)
            budget -= len(sub.prompt_ids)
            admitted += 1

    def _send_prompt_logprobs(self, sub: Submission, sink) -> bool:
        """The prompt's log-probs (one forward, on this thread: it owns the model) before the request is admitted; if
        the forward raises, this request alone fails, like a failed prefill."""
        try:
            logprobs = prompt_logprobs(self.engine.model, sub.prompt_ids, sub.prompt_logprobs)
        except Exception as e:  # noqa: BLE001 - one request's forward: it alone ends
            self.prefills_failed += 1
            errors.exception("prompt_logprobs", "a prompt log-prob forward failed (%s); failing its request", e, exc_info=e)
            self._release(1)
            _send(sink, Event(sub.index, [], True, "error", error=f"computing the prompt's log-probs failed ({type(e).__name__}: {e})",
                              error_code="engine_step_failed"))
            return False
        _send(sink, Event(sub.index, [], prompt_logprobs=logprobs))
        return True

    def _abort(self, request_id: str) -> None:
        """Abort a request; its sink still gets a final "abort" event (with the usage so far, if it ran)."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self.engine.abort(request_id)  # if this raises, the entry is still there for the outer guard to fail
            del self._entries[request_id]
            self._release(1)
            _send(entry.sink, Event(entry.index, [], True, "abort", usage=self._usage(entry)))
            return
        for item in self._backlog:
            if item[0].request_id == request_id:
                self._backlog.remove(item)
                self._release(1)
                _send(item[1], Event(item[0].index, [], True, "abort"))
                return

    def _version(self) -> int:
        drafter = self.engine.drafter
        return drafter.version if drafter is not None else 0  # swaps happen before a step, so this is the step's version

    def _deliver(self, out, version: int, now: float) -> None:
        entry = self._entries.get(out.request_id)
        if entry is None:
            return
        if out.error is not None:  # its prefill raised: the engine aborted it alone and went on
            self.prefills_failed += 1
            errors.exception("prefill", "a prefill failed (%s); failing its request", out.error, exc_info=False)
            del self._entries[out.request_id]
            self._release(1)
            _send(entry.sink, Event(entry.index, [], True, "error", error=f"the engine failed serving this request ({out.error}); the request was aborted",
                                    error_code="engine_step_failed"))
            return
        entry.versions.add(version)
        if out.new_token_ids:
            if entry.last_delivery is not None and self.on_tokens is not None:
                _hook(self.on_tokens, now - entry.last_delivery)
            entry.last_delivery = now
        event = Event(entry.index, list(out.new_token_ids), out.finished, out.finish_reason.value if out.finish_reason else None)
        start, entry.delivered = entry.delivered, entry.delivered + len(out.new_token_ids)
        if entry.request.params.logprobs:  # one step may emit a request's prefill and decode outputs: index, don't tail
            event.logprobs = list(entry.request.output_policy_logprobs[start:entry.delivered])
        if entry.request.params.top_logprobs:
            event.top_logprobs = list(entry.request.output_top_logprobs[start:entry.delivered])
        if out.finished:
            del self._entries[out.request_id]
            self._release(1)
            event.usage = self._usage(entry)
        _send(entry.sink, event)

    def _usage(self, entry: _Entry) -> dict:
        m = entry.request.metrics
        usage = m.as_dict() | {"drafter_versions": sorted(entry.versions)} | _timings(m, entry.submitted)
        if self.on_finish is not None:
            _hook(self.on_finish, usage)
        return usage

    def _fail_running(self, error: Exception) -> None:
        """A step raised: fail the requests it was decoding and the one it was prefilling (a prefill that raises
        would otherwise be retried every step, forever)."""
        self.steps_failed += 1
        failing = [*self.engine.running, *([self.engine.prefilling] if self.engine.prefilling is not None else [])]
        errors.exception(f"step:{type(error).__name__}", "engine step failed (%s: %s); failing its %d requests", type(error).__name__, error,
                         len(failing), exc_info=error)
        message = f"the engine step serving this request failed ({type(error).__name__}: {error}); the request was aborted"
        for request in failing:
            entry = self._entries.pop(request.request_id, None)
            try:
                self.engine.abort(request.request_id)
            except Exception as e:  # noqa: BLE001 - the row is dropped below either way
                errors.exception("step:abort", "abort after a failed step raised", exc_info=e)
            if entry is not None:
                self._release(1)
                _send(entry.sink, Event(entry.index, [], True, "error", error=message, error_code="engine_step_failed"))

    def _fail_all(self, message: str, code: str) -> None:
        while self._backlog:
            sub, sink = self._backlog.popleft()
            self._release(1)
            _send(sink, Event(sub.index, [], True, "error", error=message, error_code=code))
        for request_id in list(self._entries):
            entry = self._entries.pop(request_id)
            self._release(1)
            _send(entry.sink, Event(entry.index, [], True, "error", error=message, error_code=code))


def _timings(m, submitted: float) -> dict:
    """vLLM's request intervals (s): queued (submitted -> prefill start), prefill, decode (first -> last token), inference."""
    if m.first_token_time is None:
        return {}
    scheduled = m.first_token_time - m.prefill_time_s
    finished = m.finish_time if m.finish_time is not None else time.perf_counter()
    return {"queue_time_s": max(0.0, scheduled - submitted) if submitted else 0.0, "decode_time_s": max(0.0, finished - m.first_token_time),
            "inference_time_s": max(0.0, finished - scheduled)}


def _hook(hook, value) -> None:
    try:
        hook(value)
    except Exception as e:  # noqa: BLE001 - a metrics hook must not fail requests
        errors.exception("hook", "a metrics hook raised", exc_info=e)


def _send(sink, event: Event) -> None:
    try:
        sink(event)
    except Exception as e:  # noqa: BLE001 - a dead client (closed event loop) must not stop the engine loop
        errors.exception("deliver", "delivering an event failed", exc_info=e)

