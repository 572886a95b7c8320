"""What a production user meets on day one, over a real socket: the role chunk comes with the first token,
timeouts (408 / 503 queue_timeout), a failing prefill fails only its request, liveness vs readiness,
draining on SIGTERM, request ids."""
import signal
import threading
import time

import httpx
import pytest

from server_helpers import MODEL, LiveServer, tiny_config

from test_engine_loop import POISON, PoisonedPrefill


def completion(server, **body):
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "temperature": 0, "ignore_eos": True} | body, timeout=60)


def stream_lines(server, path, body, headers=None):
    """(seconds since the request was sent, line) for every SSE data line."""
    start, lines = time.perf_counter(), []
    with httpx.stream("POST", server.url + path, json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append((time.perf_counter() - start, line[6:]))
    return lines


@pytest.fixture
def slow(tiny_llama):
    """Plain decoding, 2 rows, every step slowed to >= 0.1 s."""
    def build(**overrides):
        live = LiveServer(tiny_config(tiny_llama, **({"max_batch_size": 2} | overrides)))
        live.runtime.engine.between_steps.append(lambda engine: time.sleep(0.1))
        return live
    return build


def test_the_chat_role_chunk_comes_with_the_first_token(slow):
    """vLLM sends the role with the first output: a client's TTFT then measures prefill, not the HTTP round trip."""
    import json

    with slow() as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "ignore_eos": True, "temperature": 0}
        lines = stream_lines(server, "/v1/chat/completions", body)
    first_t, first = lines[0]
    assert json.loads(first)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_t >= 0.1  # after the first (slowed) step, which prefilled the prompt
    token_t = next(t for t, line in lines[1:] if line != "[DONE]" and json.loads(line)["choices"][0]["delta"].get("content"))
    assert token_t - first_t < 0.05  # the first token follows the role chunk at once


def test_request_timeout_is_a_408_and_frees_the_row(slow):
    with slow(request_timeout_s=0.5) as server:
        r = completion(server, max_tokens=100)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        lines = stream_lines(server, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 100, "stream": True, "ignore_eos": True})
        assert '"code": "request_timeout"' in lines[-2][1] and lines[-1][1] == "[DONE]"
        deadline = time.monotonic() + 5
        while server.runtime.loop.held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.runtime.loop.held == 0 and not server.runtime.engine.has_unfinished()
        assert 'tandem:request_failure_total{kind="request_timeout",model_name="tiny"} 2.0' in httpx.get(server.url + "/metrics").text


def test_a_request_waiting_past_the_queue_timeout_is_a_503(slow):
    with slow(max_batch_size=1, queue_timeout_s=0.3) as server:
        long = threading.Thread(target=completion, args=(server,), kwargs={"max_tokens": 30})
        long.start()
        time.sleep(0.2)
        r = completion(server, max_tokens=2)
        long.join()
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout" and "retry later" in r.json()["error"]["message"]


def test_a_failing_prefill_fails_its_request_only(tiny_llama):
    with LiveServer(tiny_config(tiny_llama, max_batch_size=2)) as server:
        engine = server.runtime.engine
        engine.model = PoisonedPrefill(engine.model)
        bad = completion(server, prompt=[1, 2, POISON, 3], max_tokens=4)
        assert bad.status_code == 503 and bad.json()["error"]["code"] == "engine_step_failed"
        good = completion(server, prompt=[1, 2, 3], max_tokens=4)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.url + "/health").status_code == 200 and engine.model.raised == 1


def test_liveness_readiness_and_draining(slow):
    with slow() as server:
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
        result = {}
        inflight = threading.Thread(target=lambda: result.update(r=completion(server, max_tokens=20)))
        inflight.start()
        deadline = time.monotonic() + 10
        while not server.runtime.loop.held and time.monotonic() < deadline:
            time.sleep(0.01)
        server._server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/health?ready=1").status_code == 503 and httpx.get(server.url + "/health").status_code == 200
        refused = completion(server, max_tokens=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        inflight.join(30)
        r = result["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20  # finished, not cut
        deadline = time.monotonic() + 10
        while server._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server._thread.is_alive()  # uvicorn exited once the drain was done


def test_request_ids_are_honoured_and_returned(tiny_llama, caplog):
    import logging

    with LiveServer(tiny_config(tiny_llama, max_batch_size=2)) as server:
        with caplog.at_level(logging.INFO, logger="tandem.server"):
            r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        assert any(getattr(rec, "request_id", None) == "abc-123" and getattr(rec, "status", None) == 200 for rec in caplog.records)
        fresh = httpx.get(server.url + "/health").headers["x-request-id"]
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        odd = httpx.get(server.url + "/health", headers={"X-Request-Id": "x" * 500}).headers["x-request-id"]
        assert odd != "x" * 500 and len(odd) == 32
        denied = httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20), headers={"X-Request-Id": "big-1"}, timeout=60)
        assert denied.status_code == 413 and denied.headers["x-request-id"] == "big-1"


def test_json_lines_logs_carry_the_request_id():
    import json
    import logging

    from tandem.server.logs import JsonFormatter, RateLimitedLog

    record = logging.LogRecord("tandem.server", logging.INFO, __file__, 1, "POST %s %d", ("/v1/completions", 200), None)
    record.request_id, record.status = "abc-123", 200
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "POST /v1/completions 200" and line["request_id"] == "abc-123" and line["status"] == 200 and line["level"] == "info"
    now = [0.0]
    logger = logging.getLogger("tandem.test.ratelimit")
    limited = RateLimitedLog(logger, interval_s=10, clock=lambda: now[0])
    logged = [limited.exception("step", "boom", exc_info=False) for _ in range(1000)]
    now[0] = 11.0
    assert logged.count(True) == 1 and limited.suppressed_total == 999 and limited.exception("step", "boom", exc_info=False)


def test_the_default_batch_is_sized_from_the_kv_budget(tiny_llama):
    from tandem.models.config import ModelConfig  # noqa: F401 - the config the sizing reads
    from tandem.server.runtime import MAX_AUTO_BATCH, kv_row_bytes, sized_batch

    probe = LiveServer(tiny_config(tiny_llama, max_batch_size=1))
    row = kv_row_bytes(probe.runtime.llm.target.cfg, 128)
    probe.close()
    cfg = probe.runtime.llm.target.cfg
    assert row == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 128 * 4
    assert sized_batch(cfg, 128, 5 * row + 1) == 5 and sized_batch(cfg, 128, 10) == 1 and sized_batch(cfg, 128, 10**15) == MAX_AUTO_BATCH
    with LiveServer(tiny_config(tiny_llama, max_batch_size=None, max_queue=None, kv_cache_bytes=5 * row + 1)) as server:
        runtime = server.runtime
        assert runtime.config.max_batch_size == runtime.engine.config.max_batch_size == runtime.engine.cache.max_batch == 5
        assert runtime.config.max_queue == 20 and runtime.loop.capacity == 25
        assert completion(server, max_tokens=3).status_code == 200


def test_the_online_flywheel_is_the_benchmarks_composition(tmp_path):
    """A trained head is fine-tuned with the flywheel's defaults (not a day-0 head's lr); spilling has retention and an
    opt-out; --trainer-process reaches the flywheel."""
    from tandem.flywheel.setups import FlywheelSetup, live_options
    from tandem.server.runtime import ServerConfig, flywheel_options

    base = dict(drafter="eagle", online=True)
    strong = flywheel_options(ServerConfig(**base, drafter_path="head/", spill_max_bytes=1 << 20, spill_max_age_s=60.0, trainer_process=True), tmp_path)
    assert (strong.loss.lr, strong.loss.anchor, strong.loss.discard_weight, strong.loss.sample, strong.loss.recent_share) == (3e-4, 0.0, 0.0, "domains", 0.5)
    assert strong.loss == live_options(FlywheelSetup(), "static", {}).loss and strong.train and strong.trainer_process
    assert (strong.spill_dir, strong.spill_max_bytes, strong.spill_max_age_s) == (str(tmp_path / "traces"), 1 << 20, 60.0)
    scratch = flywheel_options(ServerConfig(**base, spill_traces=False, publish_every=3), tmp_path)
    assert (scratch.loss.lr, scratch.loss.anchor, scratch.loss.publish_every) == (1e-3, 0.0, 3) and scratch.spill_dir is None
    assert scratch.checkpoint_dir == str(tmp_path / "checkpoint") and not scratch.trainer_process
    with pytest.raises(Exception, match="--trainer-process needs --online"):
        ServerConfig(trainer_process=True)
