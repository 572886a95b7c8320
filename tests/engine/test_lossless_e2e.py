"""End to end: with every drafter, sampled output (temperature 0.8, top-p 0.9) has the target's distribution, for
seeded requests (keyed draws, the draft compared with the target's own token) and unseeded ones (rejection sampling).

The exact distribution of the first three output tokens is enumerated from the model; the engine's
empirical distribution over many seeds must pass a chi-square goodness-of-fit test. Each test's false
failure probability is 1e-4 (the p-value threshold); seeds are fixed, so a run is deterministic.
"""

import itertools

import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.models.loader import load_transformer
from tandem.models.tiny import make_tiny_model
from tandem.ops.sampling import sampling_probs
from tiny_helpers import FALSE_FAILURE, SAMPLES, SMALL_VOCAB as VOCAB, SMALL_VOCAB_PROMPT as PROMPT, chi_square_p_value, first_step_drafts

def transform(logits, params):
    n = logits.shape[0]
    return sampling_probs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p))


def exact_distribution(model, params, length=3) -> dict[tuple, float]:
    dist = {(): 1.0}
    for _ in range(length):
        contexts = [c for c in dist if dist[c] > 0]
        ids = torch.tensor([PROMPT + list(c) for c in contexts])
        with torch.inference_mode():
            probs = transform(model(ids).logits[:, -1], params)
        dist = {c + (t,): dist[c] * probs[i, t].item() for i, c in enumerate(contexts) for t in range(VOCAB)}
    return dist


def sample_outputs(path, drafter_name, params, drafter_model=None, seeded=True) -> tuple[dict[tuple, int], Engine]:
    """SAMPLES requests; seeded: seeds 0.., else unseeded requests whose generators are seeded 0.. (deterministic runs)."""
    target = load_transformer(path)
    target.pack()
    drafter = None
    if drafter_name:
        drafter = build_drafter(drafter_name, target=target, num_draft_tokens=3, max_batch=16, max_len=64, drafter_model=drafter_model)
    engine = Engine(target, EngineConfig(max_batch_size=16, max_model_len=64), drafter=drafter)
    params_list = [SamplingParams(max_tokens=3, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=s if seeded else None, ignore_eos=True) for s in range(SAMPLES)]
    with pytest.MonkeyPatch.context() as patch:
        if not seeded:
            counter = itertools.count()
            patch.setattr(Request, "make_generator", staticmethod(lambda seed: torch.Generator().manual_seed(next(counter))))
        outputs = engine.run([PROMPT] * SAMPLES, params_list)
    counts: dict[tuple, int] = {}
    for r in outputs:
        key = tuple(r.output_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, engine


@pytest.mark.parametrize("drafter_name", ["ngram", "ngram_tree", "self_draft", "draft_model"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9),
    pytest.param(SamplingParams(temperature=1.0, top_k=4), marks=pytest.mark.slow),
])
@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_output_has_target_distribution(small_vocab_model, tmp_path, drafter_name, params, seeded):
    drafter_model = str(make_tiny_model(tmp_path / "d", "llama", seed=12, vocab_size=VOCAB)) if drafter_name == "draft_model" else None
    exact = exact_distribution(load_transformer(small_vocab_model), params)
    counts, engine = sample_outputs(small_vocab_model, drafter_name, params, drafter_model, seeded)
    stats = engine.stats
    assert stats.drafted_tokens == stats.drafts == first_step_drafts(drafter_name, counts)
    assert stats.request_steps == 2 * SAMPLES - stats.accepted_tokens  # accepted: done in that verify; else one more, undrafted
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # the verifies both accepted and rejected drafts (the sampled path ran)
    assert chi_square_p_value(counts, exact, SAMPLES) > FALSE_FAILURE


def test_the_check_has_power(small_vocab_model):
    """A wrong reference (a different temperature) must fail the same test: the check can fail."""
    params = SamplingParams(temperature=0.8, top_p=0.9)
    counts, _ = sample_outputs(small_vocab_model, None, params)
    wrong = exact_distribution(load_transformer(small_vocab_model), SamplingParams(temperature=1.3))
    assert chi_square_p_value(counts, wrong, SAMPLES) < FALSE_FAILURE
    assert chi_square_p_value(counts, exact_distribution(load_transformer(small_vocab_model), params), SAMPLES) > FALSE_FAILURE
