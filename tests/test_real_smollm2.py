"""Real pretrained weights (SmolLM2-135M-Instruct from the zoo): parity with HF and greedy identity."""
import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", max_batch_size=4)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.apply_chat_template([{"role": "user", "content": PROMPT}])


def test_32_greedy_tokens_identical_to_hf(llm, prompt_ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(prompt_ids) :].tolist()
    got = llm.generate(prompt_ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == want
    assert "def" in got.text


@pytest.mark.parametrize("drafter", ["ngram", "self_draft"])
def test_drafter_greedy_identical_on_real_model(llm, prompt_ids, drafter):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = llm.generate(prompt_ids, params)[0]
    spec = llm.with_drafter(drafter, num_draft_tokens=4).generate(prompt_ids, params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.metrics["drafted_tokens"] > 0


def test_draft_model_greedy_identical_on_real_model(llm, prompt_ids):
    """SmolLM2 drafting for itself: same tokens, and every drafted token accepted."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = llm.generate(prompt_ids, params)[0]
    spec = llm.with_drafter("draft_model", num_draft_tokens=3, drafter_model="smollm2-135m").generate(prompt_ids, params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.metrics["accepted_tokens"] == spec.metrics["drafted_tokens"] > 0


def test_batched_chat_with_stop_string(llm):
    convs = [[{"role": "user", "content": "Count from 1 to 20, separated by commas."}]] * 2
    outs = llm.chat(convs, SamplingParams(max_tokens=64, temperature=0.0, stop=["5"]))
    for out in outs:
        assert "5" not in out.text and out.finish_reason == "stop"
