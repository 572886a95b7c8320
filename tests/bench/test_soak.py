"""tandem bench soak on the tiny model, over real sockets with the server in a child process: nothing hangs, the two
injected faults fail exactly the requests they logged and no other request gets a 5xx, drafter versions are swapped in."""
import json

import pytest

from tandem.bench.serving.soak import SoakConfig, run_soak
from tandem.bench.serving.soak_verdict import Result, classify, growth, growth_checks, markdown_table, state_dir_allowance_mb, verdict


def test_classify_attributes_each_5xx():
    faults = {"prefill": ["cmpl-p"], "step": ["chatcmpl-a", "cmpl-b", "cmpl-c"]}
    results = [Result("prefill_fault", "5xx", 503, "engine_step_failed"), Result("load", "5xx", 503, "engine_step_failed", "chatcmpl-a"),
               Result("load", "client_disconnected", 200, None, "cmpl-b"), Result("step_fault", "5xx", 503, "engine_step_failed", None),
               Result("load", "5xx", 503, "engine_step_failed", None), Result("load", "5xx", 503, "queue_timeout", "chatcmpl-x"),
               Result("load", "ok", 200, None, "chatcmpl-y"), Result("load", "4xx", 408, "request_timeout")]
    counts = classify(results, faults)
    # cmpl-c was logged by the step fault but never reported by id: one id-less step failure is matched to it, the second is not
    assert counts["5xx"] == {"injected_prefill": 1, "injected_step": 2, "injected_step_matched_by_count": 1, "unexplained": 2}
    assert counts["by_outcome"] == {"5xx": 5, "client_disconnected": 1, "ok": 1, "4xx": 1}
    assert counts["4xx_by_code"] == {"408 request_timeout": 1} and counts["step_fault_requests_unaccounted"] == 0


def _clean_run() -> tuple[dict, dict, dict]:
    requests = {"by_outcome": {"ok": 10}, "5xx": {"unexplained": 0, "injected_prefill": 1}, "step_fault_requests_unaccounted": 0}
    return requests, {"prefill": ["cmpl-p"], "step": ["cmpl-s"]}, {"ok": 3, "failed": 0}


def _series(key: str, values: list[float]) -> list[dict]:
    return [{"t_s": 10.0 * i, key: v} for i, v in enumerate(values)]


def test_the_verdict_fails_on_rss_and_state_dir_growth_it_cannot_explain():
    allowance = state_dir_allowance_mb(version_file_mb=1.0, online=False, spill_cap_mb=2048.0)
    assert allowance == 17.0  # the 16 newest versions plus the one served, 1 MB each; nothing else offline
    flat_state = growth(_series("state_dir_mb", [1, 5, 12, 17, 17, 17]), "state_dir_mb", warmup_s=10)
    # 600 MB after the warm-up: 150 MB growth allowed (a quarter); a leak climbing to 900 MB is not explained
    steady = growth(_series("rss_mb", [400, 600, 640, 700, 720, 730]), "rss_mb", warmup_s=10)
    leaking = growth(_series("rss_mb", [400, 600, 680, 760, 840, 900]), "rss_mb", warmup_s=10)
    assert verdict(*_clean_run(), growth_checks(steady, flat_state, allowance))["passed"]
    leak = verdict(*_clean_run(), growth_checks(leaking, flat_state, allowance))
    assert leak["rss_growth_within_bound"] is False and leak["state_dir_within_bound"] is True and not leak["passed"]
    filling = growth(_series("state_dir_mb", [1, 5, 12, 17, 18, 25]), "state_dir_mb", warmup_s=10)  # retention not holding
    disk = verdict(*_clean_run(), growth_checks(steady, filling, allowance))
    assert disk["state_dir_within_bound"] is False and disk["rss_growth_within_bound"] is True and not disk["passed"]
    unsampled = growth([], "rss_mb", warmup_s=10)  # nothing sampled after the warm-up: nothing was checked
    assert not verdict(*_clean_run(), growth_checks(unsampled, flat_state, allowance))["passed"]


@pytest.mark.slow
def test_a_short_soak_on_the_tiny_model(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"domain": "chat", "prompt": f"say {w} twice", "id": f"c{i}"}) + "\n"
                               for i, w in enumerate(("yes", "no", "maybe", "again", "hello", "abc"))))
    # a publish a second: more versions than the server keeps on disk (16), so publishing must survive retention
    config = SoakConfig(model=tiny_llama, minutes=20 / 60, concurrency=4, draft_vocab_size=200, publish_every_s=1.0, sample_every_s=2.0,
                        max_tokens=24, prompts=str(prompts), threads=1, max_batch_size=4, max_model_len=128, log_dir=str(tmp_path / "logs"))
    report = run_soak(config, progress=lambda line: None)
    requests = report["requests"]
    assert report["hung"] == 0 and requests["by_outcome"].get("transport_error", 0) == 0, report["requests"]
    assert requests["5xx"]["unexplained"] == 0, requests["unexplained_5xx"]
    assert requests["5xx"]["injected_prefill"] == 1 and len(report["faults"]["prefill"]) == 1
    # every request the failing step was running is accounted for: a 5xx seen by its client, or a client that had hung up
    assert requests["step_fault_requests_unaccounted"] == 0 and 1 <= len(report["faults"]["step"]) <= 4
    assert requests["5xx"]["injected_step"] + requests["5xx"]["injected_prefill"] == requests["by_outcome"]["5xx"]
    assert requests["4xx_by_code"] == {}  # short prompts, no queueing, no timeouts: no client error either
    assert report["server"]["engine_steps_failed"] == 1 and report["server"]["engine_prefills_failed"] == 1
    assert report["publishes"]["failed"] == 0 and report["publishes"]["ok"] >= 17, report["publishes"]  # one a second for ~20 s
    # each publish is a new version; the swapper installs the newest at a step boundary (a version superseded while it was
    # being validated is skipped), so the last one published is the one served at the end
    assert report["server"]["drafter_version"] == report["publishes"]["ok"] and report["server"]["drafter_refusals"] == 0
    assert 1 <= report["server"]["drafter_swaps"] <= report["publishes"]["ok"]
    assert report["server_exit_code"] == 0 and report["verdict"]["passed"]
    assert report["rss_mb"]["warmup_end"] is not None and len(report["samples"]) >= 9
    assert "| verdict | passed |" in markdown_table(report)


def test_a_request_past_its_limit_is_hung_and_a_dropped_connection_a_transport_error():
    import asyncio

    import httpx

    from tandem.bench.serving.soak import guarded

    async def never():
        await asyncio.sleep(30)

    async def dropped():
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    hung = asyncio.run(guarded(never(), "load", 0.2))
    assert hung.outcome == "hung" and 0.2 <= hung.latency_s < 5
    broken = asyncio.run(guarded(dropped(), "load", 5))
    assert broken.outcome == "transport_error" and "RemoteProtocolError" in broken.error


def test_a_publish_that_times_out_or_is_refused_is_counted_not_raised():
    import asyncio

    import httpx

    from tandem.bench.serving.soak import publish_once

    def handler(request):
        if request.method == "GET":
            return httpx.Response(200, json={"version": 7})
        if request.headers.get("x-mode") == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(400, json={"error": "drafter version 7 is not available"})

    async def publish(mode: str, publishes: dict) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://soak") as client:
            await publish_once(client, {"x-mode": mode}, publishes)

    publishes = {"ok": 0, "failed": 0}
    asyncio.run(publish("slow", publishes))
    asyncio.run(publish("refused", publishes))
    assert publishes == {"ok": 0, "failed": 2, "first_error": "ReadTimeout: timed out"}
