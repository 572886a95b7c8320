"""Seeded sampling draws each token on numbers keyed by (seed, position): the output is plain decoding's, bit for bit,
whatever drafts, however long its drafts, and whatever else is in the batch; the drafter races on the same numbers,
so a drafter that is the target itself has every drafted token accepted."""

import pytest

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tiny_helpers import load_packed, make_prompts, repetitive_prompts

PARAMS = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(4)]


def run(target, prompts, params, drafter=None, batch=4):
    return [r.output_ids for r in Engine(target, EngineConfig(max_batch_size=batch, max_model_len=128), drafter=drafter).run(prompts, params)]


@pytest.mark.parametrize("name", ["ngram", "suffix", "self_draft", "eagle", "eagle_ngram", "eagle_tree"])
@pytest.mark.parametrize("k", [1, 3])
def test_seeded_outputs_are_plain_decodings_whatever_drafts(tiny_llama, name, k):
    target = load_packed(tiny_llama)
    prompts = repetitive_prompts(2) + make_prompts(2)  # lookups find matches in the first two
    plain = run(target, prompts, PARAMS)
    drafter = build_drafter(name, target=target, num_draft_tokens=k, max_batch=4, max_len=128)
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=128), drafter=drafter)
    assert [r.output_ids for r in engine.run(prompts, PARAMS)] == plain
    assert engine.stats.drafted_tokens > 0  # it drafted (and the drafts did not change a token)


def test_seeded_outputs_do_not_depend_on_the_batch(tiny_llama):
    target = load_packed(tiny_llama)
    prompts = make_prompts(4, seed=3)
    together = run(target, prompts, PARAMS, build_drafter("self_draft", target=target, num_draft_tokens=3, max_batch=4, max_len=128))
    alone = [run(target, [p], [params], batch=1)[0] for p, params in zip(prompts, PARAMS)]
    assert together == alone


def test_a_drafter_that_is_the_target_has_every_seeded_draft_accepted(tiny_llama):
    """The draft model is the target's own checkpoint: it races the target's distribution on the verify's numbers, so
    it draws the target's token every time (independent draws would agree about sum_x p(x)^2 of the time)."""
    target = load_packed(tiny_llama)
    drafter = build_drafter("draft_model", target=target, num_draft_tokens=3, max_batch=4, max_len=128, drafter_model=tiny_llama)
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=128), drafter=drafter)
    outputs = [r.output_ids for r in engine.run(make_prompts(4), PARAMS)]
    assert outputs == run(target, make_prompts(4), PARAMS)
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens == 4 * 14  # a row: 1 token from the prefill, 4 steps of 3 drafted + 1, then 2 + 1
