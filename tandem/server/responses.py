"""OpenAI response bodies: full completions / chat completions and their server-sent-event chunks."""
from __future__ import annotations

import json
import time

from tandem.server.generation import Delta, EngineFailure, Generation, RequestTimeout
from tandem.server.schemas import error_body


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _head(generation: Generation, runtime, chat: bool, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": generation.id, "object": kind, "created": generation.created, "model": runtime.config.model_name}


def logprobs_body(runtime, taken: tuple[list[int], list[float]] | None, chat: bool) -> dict | None:
    """OpenAI's logprobs object for these tokens (no alternatives: top_logprobs empty / null)."""
    if taken is None:
        return None
    tokens = [runtime.token_text(t) for t in taken[0]]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []} for t, lp in zip(tokens, taken[1])]}
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(taken[1]), "top_logprobs": None, "text_offset": offsets}


def full(runtime, generation: Generation, chat: bool) -> dict:
    choices = []
    for i, choice in enumerate(generation.choices):
        logprobs = logprobs_body(runtime, choice.take_logprobs(), chat)
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": choice.text}, "logprobs": logprobs, "finish_reason": choice.finish_reason})
        else:
            choices.append({"index": i, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason})
    return _head(generation, runtime, chat) | {"choices": choices, "usage": generation.usage()}


def _chunk(runtime, generation: Generation, chat: bool, delta: Delta, first: bool) -> dict:
    logprobs = None if first else logprobs_body(runtime, generation.choices[delta.index].take_logprobs(), chat)
    if chat:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        if delta.finish_reason is not None and not delta.text and not first:
            content = {}
        choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
    else:
        choice = {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
    return _head(generation, runtime, chat, chunk=True) | {"choices": [choice]}


async def stream(runtime, request, generation: Generation, chat: bool, include_usage: bool):
    """SSE chunks until every choice finished, then (optionally) a usage chunk and `[DONE]`.

    Chat streams send the assistant role with the first engine output (after prefill), as vLLM does, so a
    client's time to first token is the model's. A disconnect cancels this generator (Starlette watches
    the connection): `finally` aborts the engine requests, which frees their cache rows.
    """
    role_sent = not chat
    try:
        next_check = time.monotonic() + 0.5
        while not generation.finished:
            event = await generation.next_event(timeout=0.5)
            if time.monotonic() >= next_check:  # besides Starlette's own watch, also while tokens flow
                next_check = time.monotonic() + 0.5
                if await request.is_disconnected():
                    return
            if event is None:
                continue
            delta = generation.apply(event)
            if not role_sent:  # the role comes first, as OpenAI sends it, once the model produced something
                role_sent = True
                for i in range(len(generation.choices)):
                    yield sse(_chunk(runtime, generation, chat, Delta(i, ""), first=True))
            if delta is not None:
                yield sse(_chunk(runtime, generation, chat, delta, first=False))
        observe(runtime, generation)
        if include_usage:
            yield sse(_head(generation, runtime, chat, chunk=True) | {"choices": [], "usage": generation.usage()})
        yield sse("[DONE]")
    except EngineFailure as e:
        runtime.metrics.failed(e.code)
        yield sse(error_body(str(e), "server_error", code=e.code))
        yield sse("[DONE]")
    except RequestTimeout as e:
        runtime.metrics.failed("request_timeout")
        yield sse(error_body(str(e), "timeout_error", code="request_timeout"))
        yield sse("[DONE]")
    finally:
        if not generation.finished:
            generation.abort()


def observe(runtime, generation: Generation) -> None:
    """Record a completed request's latency, time to first token and finish reasons."""
    m = runtime.metrics
    m.e2e_latency.observe(time.perf_counter() - generation.start)
    if generation.first_token_s is not None:
        m.ttft.observe(generation.first_token_s)
    for choice in generation.choices:
        m.success(choice.finish_reason or "abort")
