"""The handler side of one HTTP request: submit its choices to the engine loop, detokenize, cut stop strings.

A `Generation` owns one asyncio queue fed by the engine thread (through `call_soon_threadsafe`) and
yields `Delta`s: new text per choice, then each choice's finish. Text is the decode of all output ids so
far (as `LLM.generate` does), released only up to where it cannot change: an incomplete UTF-8 tail or a
possible stop-string prefix is held back. A stop string ends the choice at its first occurrence and
aborts the engine request; the choice's usage still arrives with the engine's final "abort" event.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Callable

from tandem.config import SamplingParams
from tandem.llm import stop_cut
from tandem.server.engine_loop import EngineLoop, Event, Submission

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


class Dispatcher:
    """Hands engine events to an asyncio loop with one wake-up per engine step, not one per request: the
    engine thread appends (queue, event) pairs and schedules a single flush while none is pending (60
    requests in flight were 60 `call_soon_threadsafe` self-pipe writes and loop wake-ups per step)."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dispatcher]" = weakref.WeakKeyDictionary()

    def __init__(self, aio: asyncio.AbstractEventLoop):
        self.aio = aio
        self._pending: list[tuple[asyncio.Queue, Event]] = []
        self._scheduled = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, aio: asyncio.AbstractEventLoop) -> "Dispatcher":
        found = cls._by_loop.get(aio)
        if found is None:
            found = cls._by_loop[aio] = cls(aio)
        return found

    def post(self, queue: asyncio.Queue, event: Event) -> None:
        """Any thread."""
        with self._lock:
            self._pending.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        self.aio.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for queue, event in items:
            queue.put_nowait(event)


class EngineFailure(Exception):
    """The engine could not finish this request (a failed step or loop iteration, a queue timeout, shutdown)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code or "engine_step_failed"


class RequestTimeout(Exception):
    """The request ran past its deadline (ServerConfig.request_timeout_s); its engine requests were aborted."""


@dataclass
class Delta:
    index: int
    text: str
    finish_reason: str | None = None  # set on the choice's last delta


@dataclass
class ChoiceText:
    """Incremental detokenization of one choice with stop strings, O(new tokens) per push.

    Text grows by windows (vLLM's offsets): `decode(ids[prefix:]) - decode(ids[prefix:read])` is the text the
    tokens after `read` add (decoding from `prefix` keeps a word-leading space right); it is taken only once it
    does not end in an incomplete UTF-8 sequence. Stop strings are searched in the new text plus the longest
    stop's length before it. A stop cut maps back to tokens through the window ends (`marks`). With min_tokens a stop
    string counts only once it ends past the text of the first min_tokens tokens (`tandem.llm.stop_cut`).
    """

    decode: Callable[[list[int]], str]  # token ids -> text (the tokenizer's decode, special tokens skipped)
    stops: tuple[str, ...]
    include_stop: bool = False  # include_stop_str_in_output: the matched stop string stays in the text
    min_tokens: int = 0
    echo: str = ""  # completions echo: the prompt's text, released before the first completion text
    echo_logprobs: list[tuple[int, float | None, list | None]] | None = None  # per prompt token (id, log-prob, top), with echo + logprobs
    echo_sent: bool = False
    floor: int | None = None  # characters of the first min_tokens tokens: a stop string must end past them
    token_ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters already released
    text: str = ""
    done: bool = False  # text is final (stop string, EOS, length)
    finish_reason: str | None = None
    cut_tokens: int | None = None  # tokens kept when a stop string cut the text
    logprobs: list[float] | None = None  # per token, when requested
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when alternatives were requested
    logprobs_sent: int = 0  # tokens whose log-probs were streamed
    text_offset: int = 0  # completions logprobs: characters of the tokens whose log-probs were sent
    prefix_offset: int = 0  # the decode window starts here
    read_offset: int = 0  # tokens before this are in `text`
    marks: list[tuple[int, int]] = field(default_factory=list)  # (read_offset, len(text)) after each window

    def push(self, ids: list[int], finished: bool, reason: str | None, logprobs: list[float] | None = None,
             top_logprobs: list[list[tuple[int, float]]] | None = None) -> str:
        """Add tokens; returns the newly releasable text (empty when nothing can be released yet)."""
        if self.done:
            return ""
        self.token_ids.extend(ids)
        if logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(logprobs)
        self.top_logprobs.extend(top_logprobs or [])
        before = len(self.text)
        self.text += self._new_text(final=finished)
        cut = self._find_stop(before)
        if cut is not None:
            self.done, self.finish_reason = True, "stop"
            self.cut_tokens = self._tokens_for(cut)
            self.text = self.text[:cut]
        elif finished:
            self.done, self.finish_reason = True, "stop" if reason in ("stop", "abort") else reason
        end = len(self.text) if self.done else self._safe_end()
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _new_text(self, final: bool) -> str:
        ids = self.token_ids
        if len(ids) == self.read_offset:
            return ""
        prefix = self.decode(ids[self.prefix_offset:self.read_offset]) if self.read_offset > self.prefix_offset else ""
        window = self.decode(ids[self.prefix_offset:])
        if len(window) <= len(prefix) or (window.endswith(REPLACEMENT) and not final):
            return ""  # nothing yet, or an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        new = window[len(prefix):]
        self.marks.append((self.read_offset, len(self.text) + len(new)))
        return new

    def _find_stop(self, before: int) -> int | None:
        """Where the text ends at the first stop string, searching only where the new text could complete one."""
        if not self.stops or len(self.text) == before or len(self.token_ids) <= self.min_tokens:
            return None
        if self.floor is None:  # decoded once, when the choice first has more than min_tokens tokens
            self.floor = len(self.decode(self.token_ids[: self.min_tokens])) if self.min_tokens else 0
        return stop_cut(self.text, self.stops, self.floor, self.include_stop, start=max(0, before - max(map(len, self.stops)) + 1))

    def _safe_end(self) -> int:
        """Release up to where a stop string could still begin."""
        return max(len(self.text) - (max(map(len, self.stops)) - 1 if self.stops else 0), 0)

    def _tokens_for(self, cut: int) -> int:
        """The shortest token prefix whose text reaches the stop string (what LLM.generate returns): found in the
        window that crossed `cut`, decoding only prefixes inside it."""
        if cut <= 0:
            return 0
        low = 0
        for read, length in self.marks:
            if length >= cut:
                for n in range(low + 1, read + 1):
                    if len(self.decode(self.token_ids[:n])) >= cut:
                        return n
                return read
            low = read
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.cut_tokens if self.cut_tokens is not None else len(self.token_ids)

    def take_echo(self) -> str:
        """The echoed prompt text, once (the first chunk of the choice carries it)."""
        if self.echo_sent:
            return ""
        self.echo_sent = True
        return self.echo

    def take_logprobs(self) -> list[tuple[int, float | None, list | None]] | None:
        """(token, log-prob, top alternatives or None) of the tokens not sent yet (up to the stop-string cut), echoed
        prompt tokens first, or None when not requested."""
        if self.logprobs is None and self.echo_logprobs is None:
            return None
        taken = []
        if self.echo_logprobs is not None:
            taken, self.echo_logprobs = self.echo_logprobs, []
        if self.logprobs is not None:
            end = self.num_tokens if self.done else len(self.logprobs)
            start, self.logprobs_sent = self.logprobs_sent, max(self.logprobs_sent, end)
            tops = self.top_logprobs[start:end] if self.top_logprobs else [None] * max(0, end - start)
            taken += list(zip(self.token_ids[start:end], self.logprobs[start:end], tops))
        return taken


class Generation:
    """The choices of one HTTP request in flight: `async for delta in generation` until all finish."""

    def __init__(self, loop: EngineLoop, decode, prompts: list[list[int]], params: list[SamplingParams], prefix: str,
                 timeout_s: float | None = None, request_id: str | None = None, echoes: list[str] | None = None,
                 prompt_logprobs: int | None = None):
        """echoes: per prompt, the text each of its choices starts with (completions echo); prompt_logprobs: with echo
        and logprobs, the alternatives per prompt token (the loop computes the prompt's log-probs first)."""
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.request_id = request_id or self.id  # X-Request-Id (logs, engine request ids)
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self.prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, however many choices it has
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ids = [f"{self.id}-{i}" for i in range(len(params))]
        self.choices = [ChoiceText(decode, p.stop, p.include_stop_str_in_output, p.min_tokens) for p in params]
        self.usages: list[dict | None] = [None] * len(params)
        self._engine_done = [False] * len(params)
        aio = asyncio.get_running_loop()
        per_prompt = len(params) // len(prompts)
        for i, choice in enumerate(self.choices):
            choice.echo = echoes[i // per_prompt] if echoes else ""
        subs = [Submission(rid, i, prompts[i // per_prompt], p, prompt_logprobs=prompt_logprobs) for i, (rid, p) in enumerate(zip(self._ids, params))]
        dispatcher, queue = Dispatcher.of(aio), self._queue
        loop.submit(subs, lambda event: dispatcher.post(queue, event))  # QueueFullError: nothing queued

    @property
    def finished(self) -> bool:
        return all(self._engine_done)

    async def next_event(self, timeout: float) -> Event | None:
        """The next engine event, or None after `timeout` s; RequestTimeout past the deadline (the rest is aborted)."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.abort()
                raise RequestTimeout(f"the request did not finish within {self.timeout_s:g} s and was aborted")
            timeout = max(0.0, min(timeout, left))
        if not self._queue.empty():  # no timer when the engine already answered
            return self._queue.get_nowait()
        try:
            async with asyncio.timeout(timeout):  # a timer handle, not a task per wait (wait_for's)
                return await self._queue.get()
        except TimeoutError:
            return None

    def apply(self, event: Event) -> Delta | None:
        """Fold one engine event in; returns the text to release for its choice (None: nothing new)."""
        i = event.index
        if event.error is not None:
            self._engine_done[i] = True
            self.abort()
            raise EngineFailure(event.error, event.error_code)
        if self.first_token_s is None and event.token_ids:
            self.first_token_s = time.perf_counter() - self.start
        choice = self.choices[i]
        was_done = choice.done
        if event.prompt_logprobs is not None:
            choice.echo_logprobs = event.prompt_logprobs
        text = choice.push(event.token_ids, event.finished, event.finish_reason, event.logprobs, event.top_logprobs)
        if event.finished:
            self._engine_done[i] = True
            self.usages[i] = event.usage
        elif choice.done:
            self._loop.abort([self._ids[i]])  # a stop string ended it: free the row now
        if choice.done and not was_done:
            return Delta(i, text, choice.finish_reason)
        return Delta(i, text) if text else None

    def abort(self) -> None:
        """Abort every choice the engine still runs (client gone, or a sibling failed)."""
        live = [rid for rid, done in zip(self._ids, self._engine_done) if not done]
        if live:
            self._loop.abort(live)

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": self.prompt_tokens + completion,
                "spec_decode": spec_usage([u for u in self.usages if u is not None])}


def spec_usage(usages: list[dict]) -> dict:
    """The speculative numbers of a response, summed over its choices (extension field of `usage`)."""
    total = {k: sum(u[k] for u in usages) for k in ("drafts", "drafted_tokens", "accepted_tokens", "steps", "output_tokens")}
    per_pos: list[int] = []
    for u in usages:
        for i, count in enumerate(u["accepted_per_position"]):
            per_pos.extend([0] * (i + 1 - len(per_pos)))
            per_pos[i] += count
    steps = total.pop("steps")
    emitted = total.pop("output_tokens") - len(usages)  # tokens emitted by verify steps (the first comes from prefill)
    return total | {
        "verify_steps": steps,
        "acceptance_length": round(emitted / steps, 4) if steps else 0.0,
        "acceptance_rate": round(total["accepted_tokens"] / total["drafted_tokens"], 4) if total["drafted_tokens"] else 0.0,
        "accepted_per_position": per_pos,
        "drafter_versions": sorted({v for u in usages for v in u["drafter_versions"]}),
    }
