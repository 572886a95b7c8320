"""Requests admitted together with the same prompt (a GRPO group) prefill it once: the others copy its KV rows
and its output, and every output token equals the unshared path (greedy and sampled, with drafters)."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer


def group_prompts():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (9,), generator=gen).tolist(), torch.randint(0, 256, (5,), generator=gen).tolist()
    return [a, a, b, a, b, a]


def run(path, params, share, drafter=None):
    model = load_transformer(path)
    model.pack()
    draft = build_drafter(drafter, target=model, num_draft_tokens=3, max_batch=6, max_len=128) if drafter else None
    engine = Engine(model, EngineConfig(max_batch_size=6, max_model_len=96, share_prompt_prefill=share), drafter=draft)
    requests = engine.run(group_prompts(), params)
    return [r.output_ids for r in requests], engine


@pytest.mark.parametrize("drafter", [None, "ngram", "self_draft"])
def test_greedy_outputs_equal_one_prefill_per_request(tiny_dirs, drafter):
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 6
    want, plain = run(tiny_dirs["qwen2"], params, False, drafter)
    got, engine = run(tiny_dirs["qwen2"], params, True, drafter)
    assert got == want
    assert engine.stats.prefill_tokens == plain.stats.prefill_tokens == 4 * 9 + 2 * 5
    assert engine.stats.shared_prefill_tokens == 3 * 9 + 5 and plain.stats.shared_prefill_tokens == 0


def test_sampled_outputs_equal_one_prefill_per_request(tiny_dirs):
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=s) for s in range(6)]
    want, _ = run(tiny_dirs["llama"], params, False)
    got, _ = run(tiny_dirs["llama"], params, True)
    assert got == want
    assert len({tuple(o) for o in got[:2]}) == 2  # same prompt, own seeds: the group's samples still differ


def test_prompts_admitted_in_different_steps_each_prefill(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    engine = Engine(model, EngineConfig(max_batch_size=1, max_model_len=96))  # one request per step: nothing to share
    prompt = group_prompts()[0]
    engine.run([prompt, prompt], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)] * 2)
    assert engine.stats.shared_prefill_tokens == 0 and engine.stats.prefill_tokens == 2 * len(prompt)
