"""Batched prefill (EngineConfig.prefill_batch_tokens): prompts admitted together prefill packed in shared forwards
(Transformer.forward_packed), and every output token equals the one-forward-per-request path (greedy and sampled,
with drafters)."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.admission import prefill_groups as _prefill_groups
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.errors import InvalidParameterError
from tandem.models.loader import load_transformer


def ragged_prompts(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 40, 28, 1, 60, 35][:n]  # + 5: two prompts of <= 32 tokens (their own forward), four packed
    return [torch.randint(0, 256, (k,), generator=gen).tolist() + [5, 6, 7, 5, 6] for k in lengths]


def run(path, prompts, params, prefill_batch_tokens, drafter=None):
    model = load_transformer(path)
    model.pack()
    draft = build_drafter(drafter, target=model, num_draft_tokens=3, max_batch=4, max_len=128) if drafter else None
    engine = Engine(model, EngineConfig(max_batch_size=4, max_model_len=128, prefill_batch_tokens=prefill_batch_tokens), drafter=draft)
    requests = engine.run(prompts, params)
    return [r.output_ids for r in requests], engine


@pytest.mark.parametrize("drafter", [None, "ngram", "self_draft"])
def test_greedy_outputs_equal_the_unbatched_prefill(tiny_dirs, drafter):
    prompts = ragged_prompts()
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    want, _ = run(tiny_dirs["qwen2"], prompts, params, 0, drafter)
    got, engine = run(tiny_dirs["qwen2"], prompts, params, 64, drafter)
    assert got == want
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_sampled_outputs_equal_the_unbatched_prefill(tiny_dirs):
    prompts = ragged_prompts()
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=s) for s in range(len(prompts))]
    want, _ = run(tiny_dirs["llama"], prompts, params, 0)
    got, _ = run(tiny_dirs["llama"], prompts, params, 1000)
    assert got == want


def test_groups_respect_the_token_budget():
    requests = [Request(str(i), [1] * n, SamplingParams(), None) for i, n in enumerate([4, 10, 3, 30, 2, 2])]
    groups = _prefill_groups(requests, 32)
    assert [[len(r.prompt_ids) for r in g] for g in groups] == [[4, 10, 3], [30, 2], [2]]


def test_budget_is_validated():
    with pytest.raises(InvalidParameterError):
        EngineConfig(prefill_batch_tokens=-1)


def test_long_prompts_share_packed_forwards_short_ones_take_their_own(tiny_dirs, monkeypatch):
    prompts = ragged_prompts()
    model = load_transformer(tiny_dirs["llama"])
    packed_calls = []
    original = model.forward_packed
    monkeypatch.setattr(model, "forward_packed", lambda ps, *a, **k: packed_calls.append([len(p) for p in ps]) or original(ps, *a, **k))
    engine = Engine(model, EngineConfig(max_batch_size=6, max_model_len=128, prefill_batch_tokens=120))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    assert packed_calls == [[45, 33], [65, 40]]  # <= 120 tokens each; the 8- and 6-token prompts ran alone
    assert sorted(r.row for r in engine.running) == list(range(6))
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_repeated_prompts_prefill_once_and_sample_as_unbatched(tiny_dirs):
    """A GRPO-shaped batch (2 prompts x 3 samples): the batched path forwards each prompt once and copies its KV
    row, as the unbatched path's shared prefill does; every sample equals the unbatched run's."""
    prompts = [p for p in ragged_prompts(2) for _ in range(3)]
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=s) for s in range(len(prompts))]
    model = load_transformer(tiny_dirs["llama"])
    model.pack()
    outputs, shared = [], []
    for budget in (0, 1000):
        engine = Engine(model, EngineConfig(max_batch_size=6, max_model_len=128, prefill_batch_tokens=budget))
        outputs.append([r.output_ids for r in engine.run(prompts, params)])
        shared.append(engine.stats.shared_prefill_tokens)
    assert outputs[1] == outputs[0]
    assert shared == [2 * sum(len(p) for p in ragged_prompts(2))] * 2
