"""The request fields that change what is sampled or returned, through a real (eagle-drafting) server: penalties, min_p,
min_tokens, stop_token_ids, include_stop_str_in_output equal the library's plain decoding with the same SamplingParams;
top log-probs (chat and completions) and echoed prompt log-probs equal the target's log_softmax over a direct forward."""
import httpx
import openai
import pytest
import torch

from tandem.config import SamplingParams

from server_helpers import MODEL

PROMPT = "SELECT name FROM"


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path, body):
    return httpx.post(server.url + path, json={"model": MODEL} | body, timeout=60)


def direct_logprobs(reference, ids):
    """log_softmax of the plain target at every position of `ids` (position i predicts token i + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(reference.target(torch.tensor([ids])).logits[0].float(), -1)


def test_penalties_min_p_and_min_tokens_equal_plain_decoding_with_the_same_params(server, reference):
    fields = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3, min_p=0.1, min_tokens=4)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True} | fields)
    assert r.status_code == 200, r.text
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **fields))[0]
    plain = reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == expected.text and expected.token_ids != plain.token_ids  # the penalties changed the output
    assert r.json()["usage"]["spec_decode"]["drafted_tokens"] > 0  # the server speculated: still the plain penalized output


def test_stop_token_ids_end_the_choice_after_min_tokens(server, reference):
    free = reference.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = free[2]
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == free.index(stop) + 1
    late = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop],
                                            "min_tokens": 6}).json()
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=6))[0]
    assert late["choices"][0]["text"] == expected.text and late["usage"]["completion_tokens"] == len(expected.token_ids) >= 6
    assert stop not in expected.token_ids[:6]


def test_include_stop_str_in_output_keeps_the_stop_string(server, reference):
    text = reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
    stop = text[3:5]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    cut = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    kept = post(server, "/v1/completions", body | {"include_stop_str_in_output": True}).json()["choices"][0]["text"]
    first = text.find(stop)
    assert cut == text[:first] and kept == text[: first + len(stop)]
    library = reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True))
    assert library[0].text == kept


def test_completions_top_logprobs_equal_a_direct_forward(server, reference):
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    prompt_ids = reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    out_ids = reference.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    logp = direct_logprobs(reference, prompt_ids + out_ids)[len(prompt_ids) - 1 : -1]
    text = lambda t: reference.tokenizer.decode([t])  # noqa: E731
    for i, token in enumerate(out_ids):
        values, ids = logp[i].topk(5)
        expected = {text(token): logp[i, token].item()} | {text(t): v for t, v in zip(ids.tolist(), values.tolist())}
        # keyed by token text, as OpenAI's API is: the byte-level tiny tokenizer decodes many ids to the same text, so keys
        # collide in the expected dict exactly as in the server's (built in the same order: the token, then the top 5)
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) < 1e-4 for k, v in expected.items())
        assert abs(lp.token_logprobs[i] - logp[i, token].item()) < 1e-4
    assert lp.tokens == [text(t) for t in out_ids]


def test_chat_top_logprobs_equal_a_direct_forward_streamed_and_not(server, reference):
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = reference.apply_chat_template(messages)
    out_ids = reference.generate(prompt_ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].token_ids
    logp = direct_logprobs(reference, prompt_ids + out_ids)[len(prompt_ids) - 1 : -1]
    c = client(server)
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                     extra_body={"ignore_eos": True}).choices[0].logprobs.content
    chunks = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    for content in (full, streamed):
        assert len(content) == 5
        for i, entry in enumerate(content):
            values, ids = logp[i].topk(3)
            assert [a.token for a in entry.top_logprobs] == [reference.tokenizer.decode([t]) for t in ids.tolist()]
            assert torch.allclose(torch.tensor([a.logprob for a in entry.top_logprobs]), values, atol=1e-4)
            assert entry.top_logprobs[0].bytes == list(entry.top_logprobs[0].token.encode()) and abs(entry.logprob - logp[i, out_ids[i]].item()) < 1e-4


def test_echo_returns_the_prompt_and_its_log_probs(server, reference):
    prompt_ids = reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = reference.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True}
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == PROMPT + out.text
    lp = post(server, "/v1/completions", body | {"logprobs": 2}).json()["choices"][0]["logprobs"]
    logp = direct_logprobs(reference, prompt_ids + out.token_ids)
    ids = prompt_ids + out.token_ids
    assert lp["tokens"] == [reference.tokenizer.decode([t]) for t in ids] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(expected), atol=1e-4)
    top = logp[len(prompt_ids) - 2].topk(2)  # the last prompt token's alternatives
    assert set(lp["top_logprobs"][len(prompt_ids) - 1]) >= {reference.tokenizer.decode([t]) for t in top.indices.tolist()}
    assert lp["text_offset"][: 3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    chunks = [line for line in httpx.post(server.url + "/v1/completions", json={"model": MODEL} | body | {"stream": True}, timeout=60).text.splitlines()
              if line.startswith("data: {")]
    import json

    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == PROMPT + out.text


REFUSED = [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"add_special_tokens": True}, "add_special_tokens"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages.0.tool_calls"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"min_tokens": 9}, "min_tokens"),  # above max_tokens (4)
]


@pytest.mark.parametrize("path,extra,param", REFUSED)
def test_fields_it_cannot_honour_are_refused_by_name(server, path, extra, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(server, path, base | {"max_tokens": 4} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_neutral_values_of_refused_fields_pass(server):
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "skip_special_tokens": True, "length_penalty": 1.0, "prompt_logprobs": None,
            "repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "stop_token_ids": [], "user": "someone"}
    assert post(server, "/v1/completions", body).status_code == 200
