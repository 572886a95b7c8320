"""The server on the real SmolLM2-135M-Instruct: the openai client gets what LLM.chat gives (greedy, ngram drafter)."""
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.server.background import BackgroundServer
from tandem.server.runtime import Runtime, ServerConfig

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write a SQL query that counts orders per customer."}]


def test_openai_chat_on_smollm2_matches_llm_chat():
    expected = LLM("smollm2-135m", max_batch_size=2, max_model_len=512).chat(MESSAGES, SamplingParams(max_tokens=32, temperature=0.0))[0]
    config = ServerConfig(model="smollm2-135m", drafter="ngram", max_batch_size=2, max_model_len=512)
    with BackgroundServer(Runtime(config)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == expected.text and r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.model_extra["spec_decode"]["drafted_tokens"] > 0
