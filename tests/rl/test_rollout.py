"""Rollouts for RL: exact log-probs, greedy identity and the sampled distribution with and without speculation."""
from functools import partial

import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.errors import InvalidParameterError
from tandem.models.loader import load_transformer
from tandem.ops.sampling import sampling_probs
from tandem.rl.rollout import RolloutEngine
from tiny_helpers import (FALSE_FAILURE, SAMPLES, SMALL_VOCAB as VOCAB, SMALL_VOCAB_PROMPT as PROMPT, assert_full_budget_accounting, assert_greedy_verdicts,
                          assert_replayed_drafts, chi_square_p_value, load_packed, make_prompts, ngram_chain, watch_added_requests, watch_decode_steps)

LOGPROB_TOL = 1e-4  # fp32: packed vs dense matmuls and batched vs single forwards differ by ~1e-6


def rollout_engine(path, drafter_name, max_batch=8, k=3, max_len=128):
    target = load_packed(path)
    drafter = build_drafter(drafter_name, target=target, num_draft_tokens=k, max_batch=max_batch, max_len=max_len) if drafter_name else None
    return RolloutEngine(target, drafter, EngineConfig(max_batch_size=max_batch, max_model_len=max_len))


def assert_drafts_accounted(engine, steps, requests, batch, drafter_name, k=3):
    """Every step of `engine` (a RolloutEngine's Engine, watched: watch_decode_steps, watch_added_requests) drafted what
    the drafter makes of its context and budget (prompt lookup: a replay; the model drafters: whole chains of k, cut by
    the budget), the engine counted it, and the rollouts' metrics add up to that count."""
    if drafter_name == "ngram":
        assert_replayed_drafts(engine, steps, requests, partial(ngram_chain, k=k))
    else:
        assert_full_budget_accounting(engine, steps, requests, k)
    assert sum(r.metrics["drafted_tokens"] for r in batch.rollouts) == engine.stats.drafted_tokens


def teacher_forced(model, prompt, completion, params):  # -> sampled [N], policy [N]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    index = torch.tensor(completion).view(-1, 1)
    n = len(completion)
    probs = sampling_probs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p))
    return probs.gather(-1, index).squeeze(-1).log(), torch.log_softmax(logits, -1).gather(-1, index).squeeze(-1)


@pytest.mark.parametrize("drafter_name", [None, "ngram", "self_draft"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
])
def test_logprobs_equal_a_teacher_forced_forward(tiny_llama, drafter_name, params):
    engine = rollout_engine(tiny_llama, drafter_name)
    steps, requests = watch_decode_steps(engine.engine), watch_added_requests(engine.engine)
    batch = engine.generate_rollouts(make_prompts(3, seed=5), 2, params)
    reference = load_transformer(tiny_llama)  # unpacked, no cache: a plain forward over the same tokens
    assert len(batch.rollouts) == 6 and {r.policy_version for r in batch.rollouts} == {0}
    for r in batch.rollouts:
        assert len(r.logprobs) == len(r.policy_logprobs) == len(r.completion_ids) == 20
        sampled, policy = teacher_forced(reference, r.prompt_ids, r.completion_ids, params)
        assert torch.allclose(torch.tensor(r.policy_logprobs), policy, atol=LOGPROB_TOL, rtol=0)
        assert torch.allclose(torch.tensor(r.logprobs), sampled, atol=LOGPROB_TOL, rtol=0)
        if params.greedy:
            assert r.logprobs == [0.0] * 20  # the greedy distribution is a one-hot
    if drafter_name:
        assert_drafts_accounted(engine.engine, steps, requests, batch, drafter_name)
    if drafter_name and params.greedy:
        assert_greedy_verdicts(steps, requests)
    if drafter_name == "self_draft":
        assert sum(r.metrics["accepted_tokens"] for r in batch.rollouts) > 0  # drafted tokens were really emitted


@pytest.mark.parametrize("drafter_name", ["ngram", "self_draft", "eagle"])
def test_greedy_rollouts_identical_with_and_without_speculation(tiny_llama, drafter_name):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, seed=0)
    prompts = make_prompts(4, seed=9)
    plain = rollout_engine(tiny_llama, None).generate_rollouts(prompts, 2, params)
    engine = rollout_engine(tiny_llama, drafter_name)
    steps, requests = watch_decode_steps(engine.engine), watch_added_requests(engine.engine)
    spec = engine.generate_rollouts(prompts, 2, params)
    assert [r.completion_ids for r in spec.rollouts] == [r.completion_ids for r in plain.rollouts]
    for a, b in zip(spec.rollouts, plain.rollouts):
        assert torch.allclose(torch.tensor(a.policy_logprobs), torch.tensor(b.policy_logprobs), atol=LOGPROB_TOL, rtol=0)
    assert_drafts_accounted(engine.engine, steps, requests, spec, drafter_name)
    assert_greedy_verdicts(steps, requests)


def test_generate_rollouts_validates(tiny_llama):
    engine = rollout_engine(tiny_llama, None)
    with pytest.raises(InvalidParameterError):
        engine.generate_rollouts([[1, 2]], 0, SamplingParams())


def test_profile_and_decisions_follow_the_live_batch(tiny_llama):
    from tandem.engine.control import AdaptiveDraftLength

    target = load_packed(tiny_llama)
    drafter = build_drafter("self_draft", target=target, num_draft_tokens=3, max_batch=4, max_len=128)
    engine = RolloutEngine(target, drafter, EngineConfig(max_batch_size=4, max_model_len=128), draft_policy=AdaptiveDraftLength(3))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
    batch = engine.generate_rollouts(make_prompts(3, seed=2), 2, params)
    assert max(p.batch for p in batch.profile) == 4  # 6 samples through 4 rows: the batch fills, then drains
    assert sum(len(p.ks) for p in batch.profile) == sum(r.metrics["steps"] for r in batch.rollouts)
    decisions = batch.decisions()
    assert set(decisions) <= {1, 2, 3, 4} and all(0.0 <= d["spec_share"] <= 1.0 for d in decisions.values())


# ---- the sampled distribution at temperature 1 (chi-square, with a negative control) ---------------------
def exact_distribution(model, temperature, length=3) -> dict[tuple, float]:
    dist = {(): 1.0}
    for _ in range(length):
        contexts = list(dist)
        with torch.inference_mode():
            probs = torch.softmax(model(torch.tensor([PROMPT + list(c) for c in contexts])).logits[:, -1] / temperature, -1)
        dist = {c + (t,): dist[c] * probs[i, t].item() for i, c in enumerate(contexts) for t in range(VOCAB)}
    return dist


def rollout_counts(path, drafter_name) -> tuple[dict[tuple, int], RolloutEngine]:
    engine = rollout_engine(path, drafter_name, max_batch=32, max_len=32)
    batch = engine.generate_rollouts([PROMPT], SAMPLES, SamplingParams(max_tokens=3, temperature=1.0, seed=0, ignore_eos=True))
    counts: dict[tuple, int] = {}
    for r in batch.rollouts:
        counts[tuple(r.completion_ids)] = counts.get(tuple(r.completion_ids), 0) + 1
    return counts, engine


@pytest.mark.parametrize("drafter_name", [None, "self_draft"])
def test_rollouts_at_temperature_1_have_the_policy_distribution(small_vocab_model, drafter_name):
    exact = exact_distribution(load_transformer(small_vocab_model), 1.0)
    counts, engine = rollout_counts(small_vocab_model, drafter_name)
    if drafter_name:  # max_tokens 3: a budget of 1 at each request's first verify, filled by the int8 copy; 0 after
        stats = engine.engine.stats
        assert stats.drafted_tokens == stats.drafts == SAMPLES
        assert stats.request_steps == 2 * SAMPLES - stats.accepted_tokens  # accepted: done in that verify; else one more
        assert 0 < stats.accepted_tokens < stats.drafted_tokens  # the verifies both accepted and rejected drafts
    assert chi_square_p_value(counts, exact, SAMPLES) > FALSE_FAILURE


def test_the_distribution_check_has_power(small_vocab_model):
    """Negative control: the same speculative rollouts against a deliberately wrong distribution
    (temperature 1.4 instead of 1) must fail the same test."""
    counts, _ = rollout_counts(small_vocab_model, "self_draft")
    wrong = exact_distribution(load_transformer(small_vocab_model), 1.4)
    assert chi_square_p_value(counts, wrong, SAMPLES) < FALSE_FAILURE
