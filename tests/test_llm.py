"""The public API on a tiny model: shapes of outputs, chat, stop strings, and typed errors on bad input."""
import warnings

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError, ModelLoadError, PromptTooLongError, UnknownModelError


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(tiny_dirs["llama"], max_model_len=128, max_batch_size=4)


def test_generate_strings_and_token_ids(llm):
    outs = llm.generate(["hello", [104, 105]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.finish_reason == "length" and isinstance(o.text, str) for o in outs)
    assert outs[0].prompt == "hello" and outs[1].prompt_token_ids == [104, 105]
    assert outs[0].metrics["output_tokens"] == 5


def test_chat_applies_template(llm):
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 257  # <|im_start|>
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids


def test_stop_string_cuts_text(llm):
    free = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[3:5]
    if not stop.strip():
        pytest.skip("greedy text has no printable stop candidate")
    out = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.text == free.text[: free.text.find(stop)]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"max_tokens": 0}, {"stop": [""]},
    {"temperature": float("nan")},
])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_prompt_too_long_leaves_nothing_queued(llm):
    with pytest.raises(PromptTooLongError):
        llm.generate(["ok", [1] * 200], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


def test_unknown_model():
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        LLM("no-such-model")


def test_unreadable_model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path))


def test_corrupt_weights(tiny_dirs, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dirs["llama"], bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(str(bad))


def test_unknown_drafter(tiny_dirs):
    with pytest.raises(InvalidParameterError, match="ngram"):
        LLM(tiny_dirs["llama"], drafter="nope")


def test_speculation_on_a_non_fp32_target_warns_that_it_is_not_bit_exact(tiny_dirs):
    with pytest.warns(UserWarning, match="not bit-exact"):
        LLM(tiny_dirs["llama"], dtype="bfloat16", drafter="ngram", max_model_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LLM(tiny_dirs["llama"], dtype="bfloat16", max_model_len=64)  # plain decoding: nothing to warn about
