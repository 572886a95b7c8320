"""Ragged verify: rows that draft different amounts run as one column of tokens without padding.

Pinned here: the forward gives every row the bits its own forward gives (and the padded forward gives), the engine's
greedy output, log-probs and cache equal the padded engine's and plain decoding's, a row costs exactly 1 + len(draft)
verified tokens, and sampled output keeps the target's distribution (chi-square, with a negative control).
"""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.engine.verify_inputs import pad_output, padded_inputs, ragged_inputs
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer
from tandem.types import DraftTree

from tests.engine.test_lossless_e2e import exact_distribution
from tiny_helpers import FALSE_FAILURE, SAMPLES, SMALL_VOCAB_PROMPT as PROMPT, chi_square_p_value

PROMPTS = [[5, 9, 11, 4, 7], [3, 3, 8, 1, 2, 6, 10, 12, 13], [7, 2]]
DRAFTS = [  # nothing; a chain of 3; a tree of 4 nodes (two branches under the root, one of depth 2)
    DraftTree.empty(),
    DraftTree(torch.tensor([4, 6, 8]), torch.tensor([-1, 0, 1])),
    DraftTree(torch.tensor([9, 14, 3, 2]), torch.tensor([-1, -1, 0, 1])),
]


def prefilled(model) -> KVCache:
    cache = KVCache(model.cfg, len(PROMPTS), 64, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        for row, prompt in enumerate(PROMPTS):
            model(torch.tensor([prompt]), cache=cache, rows=slice(row, row + 1), last_only=True)
    return cache


def row_alone(model, cache, b: int):
    """Row b's own forward: its pending token + draft, with its tree mask, on its own cache row."""
    ids, positions, mask = padded_inputs([1], [DRAFTS[b]], [int(cache.lengths[b])])
    with torch.inference_mode():
        return model(ids, positions=positions, cache=cache, rows=slice(b, b + 1), tree_mask=mask, taps=(0,))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ragged_forward_gives_each_row_its_own_bits(tiny_dirs, arch):
    model = load_transformer(tiny_dirs[arch])
    model.pack()
    starts = [len(p) for p in PROMPTS]
    cache = prefilled(model)
    assert model.ragged_ready(cache)
    inputs = ragged_inputs([1, 1, 1], DRAFTS, starts)
    assert inputs.lengths == [1, 4, 5] and inputs.ids.tolist() == [1, 1, 4, 6, 8, 1, 9, 14, 3, 2]
    ragged = pad_output(model.forward_ragged(inputs.ids, inputs.positions, cache, inputs.lengths, inputs.tree, taps=(0,)), inputs.lengths)
    assert cache.lengths[:3].tolist() == [s + n for s, n in zip(starts, inputs.lengths)]
    padded_cache = prefilled(model)
    ids, positions, mask = padded_inputs([1, 1, 1], DRAFTS, starts)
    with torch.inference_mode():
        padded = model(ids, positions=positions, cache=padded_cache, rows=slice(0, 3), tree_mask=mask, taps=(0,))
    alone_cache = prefilled(model)
    for b, n in enumerate(inputs.lengths):
        alone = row_alone(model, alone_cache, b)
        assert torch.equal(ragged.logits[b, :n], alone.logits[0])
        assert torch.equal(ragged.logits[b, :n], padded.logits[b, :n])
        assert torch.equal(ragged.hidden[0][b, :n], alone.hidden[0][0])
        written = slice(starts[b], starts[b] + n)  # the K/V each row wrote are the ones its own forward writes
        assert torch.equal(cache.k[:, b, :, written], alone_cache.k[:, b, :, written])
        assert torch.equal(cache.v[:, b, :, written], alone_cache.v[:, b, :, written])


def test_ragged_forward_refuses_lengths_that_do_not_add_up(tiny_llama):
    model = load_transformer(tiny_llama)
    model.pack()
    cache = prefilled(model)
    with pytest.raises(Exception, match="tokens for rows"):
        model.forward_ragged(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), cache, [1, 1, 2])
    assert cache.lengths[:3].tolist() == [len(p) for p in PROMPTS]  # nothing changed


class PerRowBudgets:
    """A draft policy giving each request a fixed budget of its own (request i: BUDGETS[i % 4])."""

    BUDGETS = (0, 3, 1, 2)

    def plan(self, requests):
        return [self.BUDGETS[int(r.request_id.split("-")[-1]) % 4] for r in requests]

    def observe(self, *args):
        pass

    def release(self, request):
        pass


def run(path, drafter_name: str | None, ragged: bool, params: list[SamplingParams], prompts, batch: int = 8):
    target = load_transformer(path)
    target.pack()
    drafter = build_drafter(drafter_name, target=target, num_draft_tokens=3, max_batch=batch, max_len=96) if drafter_name else None
    engine = Engine(target, EngineConfig(max_batch_size=batch, max_model_len=96, ragged_verify=ragged), drafter=drafter,
                    draft_policy=PerRowBudgets() if drafter_name else None)
    return engine.run(prompts, params), engine


@pytest.mark.parametrize("drafter_name", ["ngram", "ngram_tree", "self_draft"])
def test_engine_ragged_equals_padded_and_plain(tiny_qwen_small_vocab, drafter_name):
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5, 9][: 5 + i % 4] * 2 for i in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True) for _ in prompts]
    ragged_out, ragged = run(tiny_qwen_small_vocab, drafter_name, True, params, prompts)
    padded_out, padded = run(tiny_qwen_small_vocab, drafter_name, False, params, prompts)
    plain_out, _ = run(tiny_qwen_small_vocab, None, True, params, prompts)
    for r, p, q in zip(ragged_out, padded_out, plain_out):
        assert r.output_ids == p.output_ids == q.output_ids
        assert r.output_logprobs == p.output_logprobs
    s = ragged.stats
    assert s.ragged_steps == mixed_steps(ragged_out) > 0 and padded.stats.ragged_steps == 0
    assert s.verified_tokens == s.request_steps + s.drafted_tokens  # each row costs its own 1 + len(draft)
    assert padded.stats.verified_tokens > s.verified_tokens


def mixed_steps(requests) -> int:
    """Steps whose rows drafted different amounts (all requests start together, so step i is each one's i-th)."""
    lengths = [r.metrics.draft_lengths for r in requests]
    return sum(len({d[i] for d in lengths if i < len(d)}) > 1 for i in range(max(map(len, lengths))))


@pytest.fixture(scope="module")
def tiny_qwen_small_vocab(tmp_path_factory):
    from tandem.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("q16"), "qwen2", seed=5, vocab_size=16))


def sampled_counts(path, params: SamplingParams, drafter_name: str | None) -> tuple[dict[tuple, int], Engine]:
    many = [SamplingParams(max_tokens=3, temperature=params.temperature, top_p=params.top_p, seed=s, ignore_eos=True) for s in range(SAMPLES)]
    outputs, engine = run(path, drafter_name, True, many, [PROMPT] * SAMPLES, batch=16)
    counts: dict[tuple, int] = {}
    for r in outputs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    return counts, engine


def test_ragged_sampled_output_has_target_distribution(small_vocab_model):
    """False failure probability 1e-4 per assertion (the p-value threshold); fixed seeds, so deterministic."""
    params = SamplingParams(temperature=0.8, top_p=0.9)
    counts, engine = sampled_counts(small_vocab_model, params, "self_draft")
    assert engine.stats.ragged_steps > 0 and engine.stats.accepted_tokens < engine.stats.drafted_tokens
    exact = exact_distribution(load_transformer(small_vocab_model), params)
    assert chi_square_p_value(counts, exact, SAMPLES) > FALSE_FAILURE
    wrong = exact_distribution(load_transformer(small_vocab_model), SamplingParams(temperature=1.3))  # negative control
    assert chi_square_p_value(counts, wrong, SAMPLES) < FALSE_FAILURE
