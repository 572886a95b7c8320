"""The official openai client against a real server: completions, chat, streaming, n, stop, usage extension."""
import httpx
import openai
import pytest

from tandem.config import SamplingParams

from server_helpers import MODEL, LiveServer, tiny_config

PROMPTS = ["hello world", "def add(a, b):", "SELECT name FROM", "The capital of France"]


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=60, **kw)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_completions_match_llm_generate(server, reference):
    c = client(server)
    expected = [o.text for o in reference.generate(PROMPTS, greedy(12))]
    got = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}) for p in PROMPTS]
    assert [r.choices[0].text for r in got] == expected
    usage = got[0].usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(reference.tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    spec = usage.model_extra["spec_decode"]
    assert spec["drafts"] >= 1 and spec["drafted_tokens"] >= spec["drafts"] and spec["drafter_versions"] == [0]
    assert spec["acceptance_length"] == pytest.approx(11 / spec["verify_steps"], abs=1e-3)


def test_batched_prompts_and_n(server, reference):
    c = client(server)
    expected = [o.text for o in reference.generate(PROMPTS[:2], greedy(8))]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert r.usage.completion_tokens == 32


def test_chat_and_streaming_match_llm_chat(server, reference):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    expected = reference.chat(messages, greedy(16))[0].text
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.model_extra["spec_decode"]["verify_steps"] >= 1


def test_completion_streaming_and_stop_strings(server, reference):
    c = client(server)
    full = reference.generate(PROMPTS[1], greedy(20))[0].text
    stop = full[5:7]
    expected = reference.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    streamed = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.token_ids)


def test_seeded_sampling_is_plain_decodings_sample(server, reference):
    """A seeded sampled request gives the text plain decoding samples with that seed, whatever the controller drafted."""
    c = client(server)
    runs = [c.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 50}).choices[0].text
            for _ in range(2)]
    plain = reference.generate("abc", SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7))[0].text
    assert runs == [plain, plain]


def test_models_health_and_metrics(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    with httpx.Client(base_url=server.url) as h:
        assert h.get("/health").json() == {"status": "ok"}
        text = h.get("/metrics").text
    for name in ("tandem:spec_decode_num_drafts_total", "tandem:spec_decode_num_draft_tokens_total", "tandem:spec_decode_num_accepted_tokens_total",
                 'tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}', "tandem:e2e_request_latency_seconds_bucket",
                 "tandem:time_to_first_token_seconds_bucket", "tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:drafter_version",
                 'tandem:kv_cache_usage_perc{model_name="tiny"}', 'tandem:request_success_total{finished_reason="length",model_name="tiny"}',
                 "tandem:inter_token_latency_seconds_bucket", "tandem:request_queue_time_seconds_bucket", "tandem:request_prefill_time_seconds_bucket",
                 "tandem:request_decode_time_seconds_bucket", "tandem:request_prompt_tokens_bucket", "tandem:request_generation_tokens_bucket",
                 'tandem:engine_steps_failed_total{model_name="tiny"}'):
        assert name in text, name
    drafts = next(line for line in text.splitlines() if line.startswith("tandem:spec_decode_num_drafts_total"))
    assert float(drafts.split()[-1]) == server.runtime.engine.stats.drafts > 0


def test_metrics_show_the_speculation_controllers_decisions(tiny_llama):
    """A server with a drafter runs the controller by default; /metrics carries its step count, per-shape rows and
    speedups, equal to what the controller itself reports (a server of its own: one request, so a row per step)."""
    from tandem.engine.control import SpeculationController

    with LiveServer(tiny_config(tiny_llama, drafter="eagle", draft_vocab_size=200)) as server:
        client(server).completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
        policy = server.runtime.engine.draft_policy
        assert isinstance(policy, SpeculationController)
        with httpx.Client(base_url=server.url) as h:
            lines = h.get("/metrics").text.splitlines()
    value = lambda prefix: float(next(line for line in lines if line.startswith(prefix)).split()[-1])  # noqa: E731
    m = policy.metrics()
    assert value("tandem:spec_control_steps_total") == m["steps"] == server.runtime.engine.stats.steps
    rows = {shape: value(f'tandem:spec_control_shape_rows_total{{model_name="tiny",shape="{shape}"}}') for shape in m["shape_rows"]}
    assert rows == m["shape_rows"] and sum(rows.values()) == m["steps"]  # one request: a row per step, whichever shapes were chosen
    assert value("tandem:spec_control_speculating") == int(m["speculating"])
    assert value("tandem:spec_control_realised_speedup_overall") == pytest.approx(m["realised_speedup_overall"])


def test_logprobs_equal_a_teacher_forced_forward(server, reference):
    import torch

    c = client(server)
    prompt = PROMPTS[2]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs  # untempered: informative under greedy decoding too
    prompt_ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
    out_ids = reference.generate(prompt, greedy(10))[0].token_ids
    with torch.inference_mode():  # log_softmax of the plain target over prompt + completion
        logits = reference.target(torch.tensor([prompt_ids + out_ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out_ids).view(-1, 1)).squeeze(-1)
    assert len(lp.token_logprobs) == len(out_ids) == 10 and lp.tokens == [reference.tokenizer.decode([t]) for t in out_ids]
    assert torch.allclose(torch.tensor(lp.token_logprobs), expected, atol=1e-4)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0,
                                            logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(streamed) == 6 and all(t.logprob <= 0 for t in streamed)
