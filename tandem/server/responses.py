"""OpenAI response bodies: full completions / chat completions and their server-sent-event chunks."""
from __future__ import annotations

import json
import time

from tandem.server.generation import ChoiceText, Delta, EngineFailure, Generation, RequestTimeout
from tandem.server.schemas import error_body


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _head(generation: Generation, runtime, chat: bool, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": generation.id, "object": kind, "created": generation.created, "model": runtime.config.model_name}


MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity; OpenAI's and vLLM's value)


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def logprobs_body(runtime, choice: ChoiceText, chat: bool) -> dict | None:
    """OpenAI's logprobs object for the choice's tokens not sent yet (`ChoiceText.take_logprobs`), None when not asked.

    Chat: content[i] = {token, logprob, bytes, top_logprobs: the N most likely [{token, logprob, bytes}]}. Completions
    (vLLM's): tokens, token_logprobs, text_offset, and top_logprobs[i] = {token text: log-prob} of the token itself
    and the N most likely (so N or N + 1 entries); an echoed prompt's first token has None for both."""
    taken = choice.take_logprobs()
    if taken is None:
        return None
    tokens = [runtime.token_text(t) for t, _, _ in taken]
    if chat:
        return {"content": [{"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8")),
                             "top_logprobs": [_alternative(runtime, t, v) for t, v in top or []]} for text, (_, lp, top) in zip(tokens, taken)]}
    offsets = []
    for text in tokens:
        offsets.append(choice.text_offset)
        choice.text_offset += len(text)
    tops = [None if lp is None else {text: _lp(lp)} | {runtime.token_text(t): _lp(v) for t, v in top or []} for text, (_, lp, top) in zip(tokens, taken)]
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _lp(lp) for _, lp, _ in taken], "top_logprobs": tops, "text_offset": offsets}


def _alternative(runtime, token: int, logprob: float) -> dict:
    text = runtime.token_text(token)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def full(runtime, generation: Generation, chat: bool) -> dict:
    choices = []
    for i, choice in enumerate(generation.choices):
        logprobs = logprobs_body(runtime, choice, chat)
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": choice.text}, "logprobs": logprobs, "finish_reason": choice.finish_reason})
        else:
            choices.append({"index": i, "text": choice.take_echo() + choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason})
    return _head(generation, runtime, chat) | {"choices": choices, "usage": generation.usage()}


def _chunk(runtime, generation: Generation, chat: bool, delta: Delta, first: bool) -> dict:
    logprobs = None if first else logprobs_body(runtime, generation.choices[delta.index], chat)
    if chat:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        if delta.finish_reason is not None and not delta.text and not first:
            content = {}
        choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
    else:
        choice = {"index": delta.index, "text": generation.choices[delta.index].take_echo() + delta.text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason}
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
