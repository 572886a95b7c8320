"""The OpenAI-compatible HTTP API over a Runtime (FastAPI + uvicorn).

Every failure a client can cause is a 4xx with an OpenAI error body {"error": {message, type, param,
code}}: validation and unsupported fields (400), auth (401), unknown model / route (404), request
timeout (408), body size (413), capacity (429). A failed engine step or loop iteration, a queue-wait
timeout and draining are 503s (streams get an error event), and the engine loop keeps serving everyone
else. /health is liveness (the engine loop runs and is not broken), /ready (or /health?ready=1) is
readiness (also false while draining). SIGTERM/SIGINT drain: readiness turns false, new requests get
503, requests in flight finish for up to `drain_timeout_s`, then uvicorn stops and the flywheel
checkpoints; a second signal stops at once.
"""
from __future__ import annotations

import logging
import threading
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
from tandem.server.generation import EngineFailure, Generation, RequestTimeout
from tandem.server.runtime import Runtime
from tandem.server.admin_routes import add_admin_routes
from tandem.server.schemas import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from tandem.server.security import Guard

DISCONNECT_POLL_S = 0.5
FAILURE_STATUS = {"request_rejected": 400}  # engine failure code -> HTTP status (503 otherwise)
log = logging.getLogger("tandem.server")


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
    if param is None and ": " in message and message.split(": ", 1)[0].isidentifier():  # a check across fields names its field first
        return message, message.split(": ", 1)[0]
    return (f"{param}: {message}" if param else message), param


# ---- routes ----------------------------------------------------------------------------------------------
def _routes(app: FastAPI, runtime: Runtime) -> None:
    name = runtime.config.model_name

    @app.get("/health")
    async def health(ready: bool = False):
        if ready:
            return await readiness()
        if not runtime.loop.healthy:
            return JSONResponse(error_body("the engine loop is not running" if not runtime.loop.broken else "the engine loop is broken",
                                           "server_error", code="engine_stopped"), 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def readiness():
        if not runtime.ready:
            reason = "the server is draining" if runtime.draining else "the engine loop is not running"
            return JSONResponse(error_body(reason, "server_error", code="draining" if runtime.draining else "engine_stopped"), 503)
        return {"status": "ready"}

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
        echoes = [p if isinstance(p, str) else runtime.decode(i) for p, i in zip(prompts, ids)] if body.echo else None
        return await _serve(runtime, request, body, ids, "cmpl", chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, name)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} | ({"name": m.name} if m.name is not None else {})
                    for m in body.messages]
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
                                 top_k=max(0, body.top_k or 0), seed=None if body.seed is None else body.seed + i, logprobs=body.wants_logprobs(),
                                 top_logprobs=body.top_logprobs_n(), **body.sampling_fields()) for i in range(body.n)]
        runtime.validate(prompt_ids, params[0])
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from e
    except InvalidParameterError as e:
        raise ApiError(400, str(e)) from e
    return params


async def _serve(runtime: Runtime, request: Request, body, prompts: list[list[int]], prefix: str, chat: bool, echoes: list[str] | None = None):
    params = [p for ids in prompts for p in _params(runtime, body, ids, chat)]
    prompt_logprobs = body.top_logprobs_n() if echoes is not None and body.wants_logprobs() else None
    if runtime.draining:
        runtime.metrics.failed("draining")
        raise ApiError(503, "the server is shutting down and takes no new requests", "server_error", code="draining")
    try:
        generation = Generation(runtime.loop, runtime.decode, prompts, params, prefix, runtime.config.request_timeout_s,
                                request.scope.get("tandem.request_id"), echoes, prompt_logprobs)
    except QueueFullError as e:
        runtime.metrics.failed("queue_full")
        raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from e
    except LoopStoppedError as e:
        runtime.metrics.failed("engine_stopped")
        raise ApiError(503, str(e), "server_error", code="engine_stopped") from e
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = responses.stream(runtime, request, generation, chat, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        await _wait(request, generation)
    except EngineFailure as e:
        runtime.metrics.failed(e.code)
        status = FAILURE_STATUS.get(e.code, 503)
        raise ApiError(status, str(e), "invalid_request_error" if status == 400 else "server_error", code=e.code) from e
    except RequestTimeout as e:
        runtime.metrics.failed("request_timeout")
        raise ApiError(408, str(e), "timeout_error", code="request_timeout") from e
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


def draining_server(runtime: Runtime, uvicorn_config):
    """A uvicorn Server whose first SIGTERM/SIGINT drains (see the module doc) before it exits."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if runtime.draining or runtime.config.drain_timeout_s == 0:
                return super().handle_exit(sig, frame)  # a second signal (or no drain): stop now
            log.warning("signal %s: draining (%d requests in flight, up to %g s); a second signal stops at once",
                        sig, runtime.loop.held, runtime.config.drain_timeout_s)
            runtime.begin_drain()
            threading.Thread(target=self._exit_when_drained, name="tandem-drain", daemon=True).start()

        def _exit_when_drained(self) -> None:
            deadline = time.monotonic() + runtime.config.drain_timeout_s
            while runtime.loop.held and time.monotonic() < deadline:
                time.sleep(0.05)
            if runtime.loop.held:
                log.warning("drain deadline passed with %d requests in flight: they are failed", runtime.loop.held)
            self.should_exit = True

    return DrainingServer(uvicorn_config)


def serve(config, log_level: str = "info") -> None:
    """Load the model, start the engine loop, serve until a signal drains it, then close (checkpointing)."""
    import uvicorn

    from tandem.server.logs import configure

    configure(log_level, config.json_logs)
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", config.host)
    runtime = Runtime(config)
    log.info("serving %s: max batch %d, queue %d, request timeout %s s, queue timeout %s s", runtime.config.model_name,
             runtime.config.max_batch_size, runtime.config.max_queue, runtime.config.request_timeout_s, runtime.config.queue_timeout_s)
    try:
        uv = uvicorn.Config(create_app(runtime), host=config.host, port=config.port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)))
        draining_server(runtime, uv).run()
    finally:
        runtime.close()
