"""The rollout drafter bench: its config checks and the chain-of-thought prompts it decodes."""
import pytest

from tandem.bench.rl.rollout_drafters import INSTRUCTION, RolloutDrafterBench, task_prompts
from tandem.errors import InvalidParameterError


def test_config_refuses_empty_work():
    with pytest.raises(InvalidParameterError):
        RolloutDrafterBench(group_size=0)
    with pytest.raises(InvalidParameterError):
        RolloutDrafterBench(rounds=0)


def test_prompts_are_chat_templated_reasoning_gym_problems():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    from tandem.llm import load_tokenizer
    from tandem.models.zoo import resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    prompts = task_prompts(tokenizer, "basic_arithmetic", 3, seed=5)
    questions = [item["question"] for item in reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=5)]
    assert len(prompts) == 3
    for ids, question in zip(prompts, questions):
        text = tokenizer.decode(ids)
        assert f"<|im_start|>user\n{question}\n{INSTRUCTION}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
