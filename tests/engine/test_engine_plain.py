"""Plain (no drafter) decoding through the engine: greedy equals HF generate; batching changes nothing."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError, PromptTooLongError
from tandem.models.loader import load_transformer

ARCHS = ("llama", "qwen2", "qwen3")


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(l),), generator=gen).tolist() for l in torch.randint(3, 12, (n,), generator=gen)]


def hf_greedy(path, prompt, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def engine_for(path, **kw):
    model = load_transformer(path)
    model.pack()
    return Engine(model, EngineConfig(**kw))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(tiny_dirs, arch):
    engine = engine_for(tiny_dirs[arch])
    ps = prompts(2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [r.output_ids for r in engine.run(ps, [params] * 2)]
    assert got == [hf_greedy(tiny_dirs[arch], p, 12) for p in ps]


def test_batched_equals_one_at_a_time(tiny_llama):
    ps = prompts(5, seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 9, 5, 12, 1)]
    batched = [r.output_ids for r in engine_for(tiny_llama, max_batch_size=3).run(ps, params)]
    single = [engine_for(tiny_llama, max_batch_size=1).run([p], [sp])[0].output_ids for p, sp in zip(ps, params)]
    assert batched == single
    assert [len(o) for o in batched] == [3, 9, 5, 12, 1]


def test_batched_sampling_and_logprobs_equal_one_at_a_time(tiny_llama):
    # the step computes sampling probabilities, argmax and log-probs once for all rows: each request must still
    # get exactly what it gets alone (mixed temperatures / top-k / top-p, a greedy request among sampled ones)
    ps = prompts(4, seed=4)
    params = [SamplingParams(max_tokens=8, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True, logprobs=True)
              for t, k, p, s in ((1.0, 0, 1.0, 1), (0.7, 20, 1.0, 2), (0.0, 0, 1.0, None), (1.3, 0, 0.8, 3))]
    batched = engine_for(tiny_llama, max_batch_size=4).run(ps, params)
    single = [engine_for(tiny_llama, max_batch_size=1).run([p], [sp])[0] for p, sp in zip(ps, params)]
    assert [r.output_ids for r in batched] == [r.output_ids for r in single]
    assert [r.output_logprobs for r in batched] == [r.output_logprobs for r in single]
    assert [r.output_policy_logprobs for r in batched] == [r.output_policy_logprobs for r in single]
    assert all(len(r.output_logprobs) == 8 for r in batched)
    assert batched[2].output_logprobs == [0.0] * 8  # greedy: the sampled distribution is one-hot


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_llama):
    engine = engine_for(tiny_llama, max_batch_size=4)
    p = prompts(1, seed=2)[0]
    make = lambda seed: SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
    a, b, c = (r.output_ids for r in engine.run([p, p, p], [make(7), make(7), make(8)]))
    assert a == b
    assert a != c


def test_eos_stops_and_reports_reason(tiny_llama):
    engine = engine_for(tiny_llama)
    p = prompts(1, seed=3)[0]
    free = engine.run([p], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])[0].output_ids
    stop_at = free[4]
    r = engine.run([p], [SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)])[0]
    assert r.output_ids == free[: free.index(stop_at) + 1]
    assert r.finish_reason.value == "stop"


def test_bad_requests_raise_before_state_changes(tiny_llama):
    engine = engine_for(tiny_llama, max_model_len=32)
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=5))
    with pytest.raises(InvalidParameterError):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidParameterError):
        engine.add_request([1, 100000], SamplingParams())
    assert not engine.has_unfinished()
