"""The OpenAI-compatible HTTP API over a Runtime (FastAPI + uvicorn).

Every failure a client can cause is a 4xx with an OpenAI error body {"error": {message, type, param,
code}}: validation (400), auth (401), unknown model / route (404), body size (413), capacity (429).
A failed engine step is a 503 for the requests it was serving (streams get an error event), and the
engine loop keeps serving everyone else.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError, PromptTooLongError
from tandem.server import responses
from tandem.server.engine_loop import LoopStoppedError, QueueFullError
from tandem.server.generation import EngineFailure, Generation
from tandem.server.runtime import Runtime
from tandem.server.admin_routes import add_admin_routes
from tandem.server.schemas import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from tandem.server.security import Guard

DISCONNECT_POLL_S = 0.5


def create_app(runtime: Runtime) -> Guard:
    """The ASGI app: the FastAPI routes behind the guard (`.app` is the FastAPI object)."""
    app = FastAPI(title="tandem", description="OpenAI-compatible API with speculative decoding", version="0.1.0")
    app.state.runtime = runtime
    _error_handlers(app)
    _routes(app, runtime)
    if runtime.config.admin_key is not None:
        add_admin_routes(app, runtime)
    c = runtime.config
    return Guard(app, c.max_body_bytes, c.api_key, c.admin_key)


# ---- errors ----------------------------------------------------------------------------------------------
def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request, exc: ApiError):
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        message, param = _describe(exc.errors())
        return JSONResponse(error_body(message, param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)


def _describe(errors) -> tuple[str, str | None]:
    errors = list(errors)
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


# ---- routes ----------------------------------------------------------------------------------------------
def _routes(app: FastAPI, runtime: Runtime) -> None:
    name = runtime.config.model_name

    @app.get("/health")
    async def health():
        if not runtime.loop.alive:
            return JSONResponse(error_body("the engine loop is not running", "server_error"), 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tandem",
                                            "max_model_len": runtime.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, name)
        prompts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else list(body.prompt)
        ids = await run_in_threadpool(lambda: [runtime.encode_prompt(p) for p in prompts])
        return await _serve(runtime, request, body, ids, "cmpl", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, name)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            ids = await run_in_threadpool(runtime.chat_prompt, messages)
        except InvalidParameterError as e:
            raise ApiError(400, str(e), param="messages") from e
        except Exception as e:  # noqa: BLE001 - a chat template may reject a conversation (role order, ...)
            raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        return await _serve(runtime, request, body, [ids], "chatcmpl", chat=True)


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves {served!r}", "not_found_error", "model", "model_not_found")


def _params(runtime: Runtime, body, prompt_ids: list[int], chat: bool) -> list[SamplingParams]:
    max_tokens = body.max_tokens if body.max_tokens is not None else getattr(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = max(1, runtime.max_model_len - len(prompt_ids)) if chat else 16
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                 top_k=max(0, body.top_k or 0), seed=None if body.seed is None else body.seed + i,
                                 stop=body.stop_list(), ignore_eos=body.ignore_eos, logprobs=body.wants_logprobs()) for i in range(body.n)]
        runtime.validate(prompt_ids, params[0])
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from e
    except InvalidParameterError as e:
        raise ApiError(400, str(e)) from e
    return params


async def _serve(runtime: Runtime, request: Request, body, prompts: list[list[int]], prefix: str, chat: bool):
    params = [p for ids in prompts for p in _params(runtime, body, ids, chat)]
    try:
        generation = Generation(runtime.loop, runtime.decode, prompts, params, prefix)
    except QueueFullError as e:
        runtime.metrics.request_errors.labels("queue_full").inc()
        raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from e
    except LoopStoppedError as e:
        raise ApiError(503, str(e), "server_error", code="engine_stopped") from e
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = responses.stream(runtime, request, generation, chat, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        await _wait(request, generation)
    except EngineFailure as e:
        runtime.metrics.request_errors.labels("engine_step").inc()
        raise ApiError(503, str(e), "server_error", code="engine_step_failed") from e
    if not generation.finished:
        return Response(status_code=499)  # the client went away: nobody reads this
    responses.observe(runtime, generation)
    return responses.full(runtime, generation, chat)


async def _wait(request: Request, generation: Generation) -> None:
    """Fold events until every choice finished; abort the rest if the client disconnects."""
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not generation.finished:
            event = await generation.next_event(DISCONNECT_POLL_S)
            if event is not None:
                generation.apply(event)
            if time.monotonic() >= next_check:  # also while tokens flow: a busy stream never times out
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
    finally:
        if not generation.finished:  # disconnected, or cancelled: free the rows
            generation.abort()


def serve(config, log_level: str = "info") -> None:
    """Load the model, start the engine loop, serve until interrupted, then close (checkpointing)."""
    import logging

    import uvicorn

    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logging.getLogger("tandem.server").warning("serving on %s without --api-key: anyone who can reach this port can use it", config.host)
    runtime = Runtime(config)
    try:
        uvicorn.run(create_app(runtime), host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        runtime.close()
