"""The domain-shifting stream: blocks per domain, each domain's share, keys, the static head's prompts kept out."""
import json

import pytest

from tandem.errors import InvalidParameterError
from tandem.flywheel.stream import SPECIALISED, StreamSpec, build_stream, per_domain_need, prompt_key


class CharTokenizer:
    """One id per character of the rendered turn (what build_stream needs of a tokenizer)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [ord(c) % 256 for c in "<user>" + messages[0]["content"] + "<assistant>"]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"domain": d, "prompt": f"{d} task {i}" + ("!" * 500 if i == 0 else ""), "id": f"{d}/{i}"} for d in ("code", "sql", "summary") for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_per_domain_need_counts_each_domains_requests():
    assert per_domain_need(StreamSpec(requests=25, block=4, domains=("a", "b", "c"))) == {"a": 9, "b": 8, "c": 8}
    assert SPECIALISED == ("code", "sql", "math", "summary", "translation")


def test_blocks_cycle_and_long_prompts_stay_out(prompts_file):
    spec = StreamSpec(prompts=prompts_file, requests=24, block=4, domains=("code", "sql", "summary"), max_prompt_tokens=100)
    stream, ids, static = build_stream(spec, CharTokenizer())
    assert [p.domain for p in stream[::4]] == ["code", "sql", "summary", "code", "sql", "summary"]
    assert static == {} and set(ids) == {prompt_key(p) for p in stream}
    assert all(not p.id.endswith("/0") for p in stream)  # the 500-character prompts are over the token limit
    assert len({prompt_key(p) for p in stream}) == 24  # 29 usable prompts per domain: no repeats yet


def test_the_static_heads_prompts_never_enter_the_stream(prompts_file):
    spec = StreamSpec(prompts=prompts_file, requests=60, block=10, domains=("code", "sql"), max_prompt_tokens=100, static_prompts=5)
    stream, _, static = build_stream(spec, CharTokenizer())
    assert len(static) == 5 and all(k.startswith("code:") for k in static)
    assert not static.keys() & {prompt_key(p) for p in stream}


def test_bad_specs_are_refused():
    with pytest.raises(InvalidParameterError):
        StreamSpec(requests=0)
    with pytest.raises(InvalidParameterError):
        StreamSpec(domains=())
