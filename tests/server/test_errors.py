"""Bad input is a 4xx with an OpenAI error body, never a 5xx; auth, body limit, back-pressure, disconnects, engine faults."""
import json
import threading
import time

import httpx
import pytest

from server_helpers import MODEL, LiveServer, tiny_config

API_KEY, ADMIN_KEY = "sk-test-0123456789", "admin-0123456789"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", "[]", 400),
    ("/v1/completions", '"a string"', 400),
    ("/v1/completions", {"prompt": "hi"}, 400),
    ("/v1/completions", OK | {"prompt": 5}, 400),
    ("/v1/completions", OK | {"prompt": ""}, 400),
    ("/v1/completions", OK | {"prompt": [999999]}, 400),
    ("/v1/completions", OK | {"prompt": []}, 400),
    ("/v1/completions", OK | {"max_tokens": "5"}, 400),
    ("/v1/completions", OK | {"max_tokens": -1}, 400),
    ("/v1/completions", OK | {"max_tokens": 0}, 400),
    ("/v1/completions", OK | {"max_tokens": 1.5}, 400),
    ("/v1/completions", OK | {"temperature": 2.5}, 400),
    ("/v1/completions", OK | {"temperature": -0.1}, 400),
    ("/v1/completions", OK | {"temperature": "hot"}, 400),
    ("/v1/completions", OK | {"top_p": 0}, 400),
    ("/v1/completions", OK | {"top_k": -2}, 400),
    ("/v1/completions", OK | {"n": 0}, 400),
    ("/v1/completions", OK | {"n": 1000}, 400),
    ("/v1/completions", OK | {"stop": [""]}, 400),
    ("/v1/completions", OK | {"stream": "yes"}, 400),
    ("/v1/completions", OK | {"seed": -1}, 400),
    ("/v1/completions", OK | {"logprobs": 21}, 400),  # more alternatives than MAX_TOP_LOGPROBS
    ("/v1/completions", OK | {"prompt": "x" * 200}, 400),  # over the 128-token context
    ("/v1/completions", OK | {"max_tokens": 500}, 400),
    ("/v1/completions", OK | {"model": "gpt-4"}, 404),
    ("/v1/chat/completions", CHAT | {"messages": []}, 400),
    ("/v1/chat/completions", CHAT | {"messages": "hi"}, 400),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", CHAT | {"model": "nope"}, 404),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400),  # unsupported: refused, not ignored
    ("/v1/chat/completions", CHAT | {"tool_choice": "required"}, 400),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, 400),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"5": 10}}, 400),
    ("/v1/completions", OK | {"logit_bias": {"5": -100}}, 400),
    ("/v1/completions", OK | {"suffix": "end"}, 400),
    ("/v1/completions", OK | {"guided_json": {"type": "object"}}, 400),
    ("/v1/nothing", OK, 404),
]


def assert_openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_is_a_4xx_with_an_openai_error(server, path, body, status):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, status)


def test_unsupported_fields_name_themselves_and_neutral_values_pass(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT | {"response_format": {"type": "json_object"}}, timeout=30)
    assert r.json()["error"]["param"] == "response_format" and "structured output is not supported" in r.json()["error"]["message"]
    neutral = CHAT | {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}}
    assert httpx.post(server.url + "/v1/chat/completions", json=neutral, timeout=30).status_code == 200


def test_the_server_still_serves_after_bad_input(server):
    r = httpx.post(server.url + "/v1/completions", json=OK, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture(scope="module")
def guarded(tiny_llama):
    """Keys, a 4 KiB body limit, room for 2 requests, and steps slowed by a sleeping between-steps hook."""
    config = tiny_config(tiny_llama, drafter="eagle", draft_vocab_size=200, api_key=API_KEY, admin_key=ADMIN_KEY,
                         max_batch_size=2, max_queue=0, max_body_bytes=4096)
    with LiveServer(config) as live:
        live.runtime.engine.between_steps.append(lambda engine: time.sleep(0.01))
        yield live


def post(server, body, key=API_KEY, path="/v1/completions", **kw):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def test_api_key_is_required_on_v1_only(guarded):
    assert_openai_error(post(guarded, OK, key=None), 401)
    assert_openai_error(post(guarded, OK, key="sk-wrong-000000000"), 401)
    assert_openai_error(post(guarded, OK, key=ADMIN_KEY), 401)
    assert post(guarded, OK).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_admin_routes_need_the_admin_key(guarded, server):
    assert_openai_error(httpx.get(guarded.url + "/admin/drafter"), 401)
    assert_openai_error(httpx.get(guarded.url + "/admin/drafter", headers={"Authorization": f"Bearer {API_KEY}"}), 401)
    status = httpx.get(guarded.url + "/admin/drafter", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert status["version"] == 0 and status["available_versions"] == [0] and status["training"] is None
    assert_openai_error(httpx.get(server.url + "/admin/drafter"), 404)  # no --admin-key: no admin routes at all


def test_oversize_bodies_are_refused(guarded):
    big = OK | {"prompt": "x" * 5000}
    assert_openai_error(post(guarded, big), 413)
    chunks = (b"x" * 1024 for _ in range(8))  # chunked: no content-length to check up front
    r = httpx.post(guarded.url + "/v1/completions", content=chunks, headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert_openai_error(r, 413)


def stream_first_chunk(server, body, opened: threading.Event, close: threading.Event):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, headers=headers, timeout=60) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)
        opened.set()
        close.wait(30)


def test_back_pressure_and_disconnect_aborts(guarded):
    long = OK | {"max_tokens": 100, "ignore_eos": True}
    runtime = guarded.runtime
    before = runtime.engine.stats.output_tokens
    opened, close = [threading.Event(), threading.Event()], threading.Event()
    threads = [threading.Thread(target=stream_first_chunk, args=(guarded, long, o, close)) for o in opened]
    for t in threads:
        t.start()
    assert all(o.wait(30) for o in opened)
    r = post(guarded, OK)  # capacity 2 (batch 2 + queue 0) is taken
    assert_openai_error(r, 429)
    assert r.json()["error"]["type"] == "rate_limit_error"
    close.set()  # both clients disconnect mid-stream
    for t in threads:
        t.join(30)
    deadline = time.monotonic() + 10
    while (runtime.loop.held or runtime.engine.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runtime.loop.held == 0 and not runtime.engine.running and not runtime.engine.waiting
    assert runtime.engine.stats.output_tokens - before < 2 * 100  # aborted before finishing
    assert post(guarded, OK).status_code == 200


def test_non_streaming_client_timeout_aborts_its_request(guarded):
    runtime = guarded.runtime
    before = runtime.engine.stats.output_tokens
    with pytest.raises(httpx.TimeoutException):
        post(guarded, OK | {"max_tokens": 100, "ignore_eos": True}, timeout=0.3)
    deadline = time.monotonic() + 30
    while runtime.loop.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runtime.loop.held == 0 and not runtime.engine.running
    assert runtime.engine.stats.output_tokens - before < 100  # aborted, not run to the end


def test_a_failing_step_fails_its_requests_and_the_loop_carries_on(guarded):
    engine = guarded.runtime.engine
    armed = {"raise": True}

    def fault(engine):  # a real engine hook, raising once while a request runs
        if armed["raise"] and engine.running:
            armed["raise"] = False
            raise RuntimeError("injected fault")

    engine.between_steps.append(fault)
    try:
        r = post(guarded, OK | {"max_tokens": 20})
        assert_openai_error(r, 503)
        assert r.json()["error"]["code"] == "engine_step_failed" and "injected fault" in r.json()["error"]["message"]
        assert not armed["raise"] and guarded.runtime.loop.alive and guarded.runtime.loop.steps_failed == 1
        assert post(guarded, OK).status_code == 200
        assert not engine.running and guarded.runtime.loop.held == 0
    finally:
        engine.between_steps.remove(fault)
