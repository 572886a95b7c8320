"""min_tokens, min_p and the repetition / frequency / presence penalties change the target's distribution: plain decoding
follows an independent reference (a full forward per token, the adjustments written out), and speculation, chains and
trees, stays token-identical to plain greedy decoding and has the adjusted distribution when sampling."""
from collections import Counter

import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer
from tandem.ops.sampling import apply_penalties, sampling_probs, suppress_tokens
from tiny_helpers import (FALSE_FAILURE, SAMPLES, SMALL_VOCAB as VOCAB, SMALL_VOCAB_PROMPT as PROMPT, assert_full_budget_accounting, assert_greedy_verdicts,
                          assert_replayed_drafts, chi_square_p_value, first_step_drafts, load_packed, ngram_chain, ngram_trie, repetitive_prompts,
                          watch_decode_steps)

PENALIZED = dict(repetition_penalty=1.6, frequency_penalty=0.3, presence_penalty=0.2)


def engine_for(path, drafter=None, batch=4, **kw):
    target = load_packed(path)
    draft = build_drafter(drafter, target=target, num_draft_tokens=4, max_batch=batch, max_len=128, **kw) if drafter else None
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=128), drafter=draft)


def reference_logits(model, prompt, output, params, eos_ids):
    """The adjusted logits written out one token at a time (vLLM's definitions), over a full forward."""
    with torch.inference_mode():
        raw = model(torch.tensor([prompt + output])).logits[0, -1].float()
    logits = raw.clone()  # outside inference mode: a tensor that can be written
    if len(output) < params.min_tokens:
        for t in set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids):
            logits[t] = float("-inf")
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
    for t, count in Counter(output).items():
        logits[t] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def reference_greedy(path, prompt, params, eos_ids):
    model, output = load_transformer(path), []
    while len(output) < params.max_tokens:
        output.append(int(reference_logits(model, prompt, output, params, eos_ids).argmax()))
        if output[-1] in params.stop_token_ids or (output[-1] in eos_ids and not params.ignore_eos):
            break
    return output


def test_penalties_and_min_p_ops_known_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    out = apply_penalties(logits, prompt, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # 2 / 2 (prompt); -1 * 2 (prompt); 0.5 / 2 - 0.5 * 2 - 0.25 (twice in the output); 3 untouched
    assert out.tolist() == [[1.0, -2.0, -1.0, 3.0]]
    assert suppress_tokens(logits, torch.tensor([[False, False, False, True]])).argmax().item() == 0
    probs = sampling_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                           min_p=torch.tensor([0.35]))  # keep p >= 0.175: the first two, renormalized
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


LOOKUPS = {"ngram": ngram_chain, "ngram_tree": ngram_trie}


@pytest.mark.parametrize("drafter,penalties", [(None, PENALIZED), ("self_draft", PENALIZED),
                                               # prompt lookup finds nothing to draft once strong penalties stop the output repeating
                                               ("ngram", {"repetition_penalty": 1.15}), ("ngram_tree", {"repetition_penalty": 1.15})])
def test_penalized_greedy_follows_the_reference_with_and_without_speculation(tiny_llama, drafter, penalties):
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **penalties)
    engine = engine_for(tiny_llama, drafter)
    steps = watch_decode_steps(engine)
    requests = engine.run(prompts, [params] * len(prompts))
    got = [r.output_ids for r in requests]
    assert got == [reference_greedy(tiny_llama, p, params, engine.eos_ids) for p in prompts]
    unpenalized = [r.output_ids for r in engine_for(tiny_llama).run(prompts, [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4)]
    assert got != unpenalized  # the penalties changed the output
    if drafter in LOOKUPS:  # what prompt lookup drafts, replayed on the contexts the run produced
        assert_replayed_drafts(engine, steps, requests, LOOKUPS[drafter])
    elif drafter:  # the int8 copy drafts whole chains of k = 4
        assert_full_budget_accounting(engine, steps, requests, 4)
    if drafter:  # each step accepted the path of its draft that the penalized output continues with
        assert_greedy_verdicts(steps, requests)
        assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens  # power: the drafts met both verdicts


@pytest.mark.parametrize("drafter", [None, "self_draft"])
def test_min_tokens_suppresses_stop_tokens_until_reached(tiny_llama, drafter):
    prompt = repetitive_prompts(1, seed=3)[0]
    free = engine_for(tiny_llama).run([prompt], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)])[0].output_ids
    stop = free[1]  # greedy would stop at its second token
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=6)
    engine = engine_for(tiny_llama, drafter)
    [request] = engine.run([prompt], [params])
    assert engine_for(tiny_llama).run([prompt], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))])[0].output_ids == free[:2]
    assert request.output_ids == reference_greedy(tiny_llama, prompt, params, engine.eos_ids)
    assert stop not in request.output_ids[:6] and len(request.output_ids) >= 6


def exact_distribution(model, params, length=3):
    """The adjusted target's exact distribution over the first `length` tokens (the reference transform above)."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for context, mass in dist.items():
            if mass == 0:
                continue
            logits = reference_logits(model, PROMPT, list(context), params, set())
            one = torch.ones(1)
            probs = sampling_probs(logits.unsqueeze(0), one * params.temperature, torch.zeros(1, dtype=torch.long), one * params.top_p,
                                   min_p=one * params.min_p)[0]
            nxt.update({context + (t,): mass * probs[t].item() for t in range(VOCAB)})
        dist = nxt
    return dist


@pytest.mark.parametrize("drafter", [None, "ngram", "self_draft"])
def test_sampled_penalized_min_p_output_has_the_adjusted_distribution(small_vocab_model, drafter):
    params = SamplingParams(max_tokens=3, temperature=0.9, top_p=0.95, min_p=0.05, ignore_eos=True, **PENALIZED)
    exact = exact_distribution(load_transformer(small_vocab_model), params)
    target = load_packed(small_vocab_model)
    draft = build_drafter(drafter, target=target, num_draft_tokens=3, max_batch=16, max_len=64) if drafter else None
    engine = Engine(target, EngineConfig(max_batch_size=16, max_model_len=64), drafter=draft)
    outputs = engine.run([PROMPT] * SAMPLES, [SamplingParams(**(params.__dict__ | {"seed": s})) for s in range(SAMPLES)])
    counts = Counter(tuple(r.output_ids) for r in outputs)
    assert chi_square_p_value(counts, exact, SAMPLES) > FALSE_FAILURE
    unadjusted = exact_distribution(load_transformer(small_vocab_model), SamplingParams(max_tokens=3, temperature=0.9, top_p=0.95, ignore_eos=True))
    assert chi_square_p_value(counts, unadjusted, SAMPLES) < FALSE_FAILURE  # the check can tell the adjustments apart
    if drafter:  # max_tokens 3: one draft of one token at each request's first verify
        stats = engine.stats
        assert stats.drafted_tokens == stats.drafts == first_step_drafts(drafter, counts)
        assert stats.request_steps == 2 * SAMPLES - stats.accepted_tokens  # accepted: done in that verify; else one more, undrafted
        assert 0 < stats.accepted_tokens < stats.drafted_tokens  # the verifies both accepted and rejected drafts (the sampled path ran)
