"""Chunked prefill (EngineConfig.prefill_chunk_tokens): a long prompt is read a few tokens per step while
running requests keep decoding every step; outputs equal whole-prompt prefill (greedy, sampled, with
drafters), the chunks' taps add up to the whole prompt's, and aborting mid-prefill loses nothing else."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models.loader import load_transformer

LENGTHS = [3, 29, 8, 1, 22, 5]


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=gen).tolist() + [5, 6, 7, 5, 6] for k in LENGTHS]


def engine_for(path, chunk, drafter=None, batch=3):
    model = load_transformer(path)
    model.pack()
    draft = build_drafter(drafter, target=model, num_draft_tokens=3, max_batch=batch, max_len=128) if drafter else None
    return Engine(model, EngineConfig(max_batch_size=batch, max_model_len=96, prefill_chunk_tokens=chunk), drafter=draft)


@pytest.mark.parametrize("drafter", [None, "ngram", "eagle"])
def test_greedy_outputs_equal_whole_prompt_prefill(tiny_dirs, drafter):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 12, 7, 15, 3, 9)]  # finish at different steps
    want = [r.output_ids for r in engine_for(tiny_dirs["qwen2"], 0, drafter).run(prompts(), params)]
    engine = engine_for(tiny_dirs["qwen2"], 4, drafter)
    assert [r.output_ids for r in engine.run(prompts(), params)] == want
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts())
    assert engine.prefilling is None and not engine.has_unfinished()


def test_sampled_outputs_equal_whole_prompt_prefill(tiny_dirs):
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=s) for s in range(len(LENGTHS))]
    want = [r.output_ids for r in engine_for(tiny_dirs["llama"], 0).run(prompts(), params)]
    assert [r.output_ids for r in engine_for(tiny_dirs["llama"], 5).run(prompts(), params)] == want


def test_chunks_add_up_to_the_whole_prompt_forward(tiny_dirs):
    """What drafters and trace recording see at the first token: last logits, taps and final hidden states of
    every prompt position, equal to one whole-prompt forward."""
    seen = {}
    for chunk in (0, 4):
        engine = engine_for(tiny_dirs["llama"], chunk)
        engine.taps = (0, 2)
        first_token = engine._first_token
        engine._first_token = lambda request, out, start, chunk=chunk: seen.setdefault(chunk, out) and first_token(request, out, start)
        engine.run([prompts()[1]], [SamplingParams(max_tokens=2, temperature=0.0)])
    whole, chunked = seen[0], seen[4]
    assert chunked.final_hidden.shape == whole.final_hidden.shape == (1, len(prompts()[1]), 64)
    assert torch.allclose(chunked.logits[0, -1], whole.logits[0, -1], atol=1e-4)
    assert all(torch.allclose(c, w, atol=1e-4) for c, w in zip(chunked.hidden, whole.hidden, strict=True))
    assert torch.allclose(chunked.final_hidden, whole.final_hidden, atol=1e-4)


def test_running_requests_decode_every_step_while_a_long_prompt_is_read(tiny_dirs):
    engine = engine_for(tiny_dirs["llama"], 4)
    short = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    long_prompt = list(range(10, 40))  # 30 tokens: 8 steps of 4 (the short one's decode shares no budget)
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for step in range(1, 9):
        out = {o.request_id: o for o in engine.step()}
        assert len(out[short].new_token_ids) == 1  # never stalled
        assert (long in out) == (step == 8)  # first token after the last chunk
        assert engine.prefilling is None if step == 8 else engine.prefilling.request_id == long


def test_abort_mid_prefill_frees_the_row_and_keeps_the_rest(tiny_dirs):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = engine_for(tiny_dirs["llama"], 0).run([[1, 2, 3], [7, 8, 9, 10]], [params] * 2)
    engine = engine_for(tiny_dirs["llama"], 4)
    a = engine.add_request([1, 2, 3], params)
    b = engine.add_request(list(range(10, 40)), params)
    outputs: dict[str, list[int]] = {}
    for o in engine.step():
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.prefilling.request_id == b
    engine.abort(b)
    assert engine.prefilling is None
    c = engine.add_request([7, 8, 9, 10], params)
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert outputs[a] == want[0].output_ids and outputs[c] == want[1].output_ids
    assert b not in outputs


def test_chunk_budget_is_validated():
    with pytest.raises(InvalidParameterError):
        EngineConfig(prefill_chunk_tokens=-1)
    with pytest.raises(InvalidParameterError):
        EngineConfig(prefill_batch_tokens=-1)



class FailingPrefill:
    """The target, except that a prefill chunk (last_only) holding token 7 raises."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids, *args, **kwargs):
        if kwargs.get("last_only") and 7 in ids.tolist()[0]:
            raise RuntimeError("injected prefill fault")
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_prefill_that_raises_ends_its_request_alone(tiny_dirs):
    """A chunked prefill that raises aborts that request (a finished output carrying the error); the requests
    decoding, and the next prompt prefilled in the same step, go on as if it had never come."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = engine_for(tiny_dirs["llama"], 0).run([[1, 2, 3], [4, 5, 6]], [params] * 2)
    engine = engine_for(tiny_dirs["llama"], 64)
    engine.model = FailingPrefill(engine.model)
    a = engine.add_request([1, 2, 3], params)
    outputs: dict[str, list] = {}
    for o in engine.step():
        outputs.setdefault(o.request_id, []).append(o)
    bad = engine.add_request([9, 7, 9], params)
    c = engine.add_request([4, 5, 6], params)
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    assert [(o.finished, o.finish_reason.value, o.new_token_ids) for o in outputs[bad]] == [(True, "abort", [])]
    assert "injected prefill fault" in outputs[bad][0].error and engine.prefilling is None
    assert [t for o in outputs[a] for t in o.new_token_ids] == want[0].output_ids
    assert [t for o in outputs[c] for t in o.new_token_ids] == want[1].output_ids


class CountingPacked:
    """The target; records the prompts of every packed forward and raises in one that holds BAD (token 7 twice
    in a row), or in a lone prefill of such a prompt."""

    def __init__(self, model):
        self.model, self.packed_calls = model, []

    def forward_packed(self, prompts, *args, **kwargs):
        self.packed_calls.append(len(prompts))
        if any(_bad(p) for p in prompts):
            raise RuntimeError("injected packed prefill fault")
        return self.model.forward_packed(prompts, *args, **kwargs)

    def __call__(self, ids, *args, **kwargs):
        if kwargs.get("last_only") and _bad(ids.tolist()[0]):
            raise RuntimeError("injected prefill fault")
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _bad(prompt):
    return any(a == b == 7 for a, b in zip(prompt, prompt[1:]))


def _long_prompts():
    return [[10 + i] * 20 + list(range(20, 40)) for i in range(4)]  # 40 tokens each: prefill-shaped (packable)


def test_whole_prompts_that_fit_the_budget_prefill_packed_in_one_step(tiny_dirs):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = engine_for(tiny_dirs["llama"], 0, batch=4).run(_long_prompts(), [params] * 4)
    engine = engine_for(tiny_dirs["llama"], 130, batch=4)  # 3 whole prompts (120 tokens) + 10 tokens of the 4th
    engine.model = CountingPacked(engine.model)
    ids = [engine.add_request(p, params) for p in _long_prompts()]
    got = {i: [] for i in ids}
    for o in engine.step():
        got[o.request_id] += o.new_token_ids
    assert engine.model.packed_calls == [3] and len(engine.running) == 3 and engine.prefilling.request_id == ids[3]
    assert [len(got[i]) for i in ids] == [2, 2, 2, 0]  # the first token from the prefill, the second from this step's decode
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert [got[i] for i in ids] == [w.output_ids for w in want]


def test_a_failing_prompt_of_a_packed_prefill_ends_alone(tiny_dirs):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    good = _long_prompts()[:3]
    want = engine_for(tiny_dirs["llama"], 0, batch=4).run(good, [params] * 3)
    engine = engine_for(tiny_dirs["llama"], 400, batch=4)
    engine.model = CountingPacked(engine.model)
    bad_prompt = [7, 7] + good[0][2:]
    a, bad, b, c = (engine.add_request(p, params) for p in (good[0], bad_prompt, good[1], good[2]))
    got: dict[str, list] = {}
    for o in engine.step():
        got.setdefault(o.request_id, []).append(o)
    assert engine.model.packed_calls == [4]  # the packed forward raised; the prompts were redone one by one
    assert [(o.finished, o.finish_reason.value, o.new_token_ids) for o in got[bad]] == [(True, "abort", [])]
    assert "injected prefill fault" in got[bad][0].error and len(engine.running) == 3
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert [[t for o in got[i] for t in o.new_token_ids] for i in (a, b, c)] == [w.output_ids for w in want]


@pytest.mark.parametrize("drafter", [None, "ngram", "eagle"])
def test_a_failing_prompt_admitted_beside_running_requests_ends_alone(tiny_dirs, drafter):
    """Requests decoding, then a step that admits four prompts, the second failing: its abort moves the last admitted
    row into its hole, and every drafter keeps its per-row state through the move (the soak's prefill fault once
    failed the whole step with an EAGLE drafter: KeyError in move_row)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _long_prompts()
    running, admitted = prompts[:2], [prompts[2], [7, 7] + prompts[3][2:], prompts[3], prompts[0][::-1]]
    good = running + [p for p in admitted if not _bad(p)]
    want = engine_for(tiny_dirs["llama"], 0, drafter, batch=6).run(good, [params] * len(good))
    engine = engine_for(tiny_dirs["llama"], 400, drafter, batch=6)
    engine.model = CountingPacked(engine.model)
    ids = [engine.add_request(p, params) for p in running]
    got: dict[str, list] = {}
    for _ in range(2):
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    ids += [engine.add_request(p, params) for p in admitted]
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    bad = ids[3]
    assert [(o.finished, o.finish_reason.value, o.new_token_ids) for o in got[bad]] == [(True, "abort", [])]
    assert [[t for o in got[i] for t in o.new_token_ids] for i in ids if i != bad] == [w.output_ids for w in want]


@pytest.mark.parametrize("drafter", [None, "ngram", "eagle"])
def test_a_failing_prefill_after_one_that_finished_at_its_first_token(tiny_dirs, drafter):
    """Admitted together: a request that ends at its first token, then two with one prompt whose prefill raises.
    Releasing them must not move a failed one (which holds no drafter state) into another's row: with EAGLE that raised
    KeyError in move_row and failed the whole step (found by `tandem bench soak`)."""
    once, params = SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _long_prompts()
    want = engine_for(tiny_dirs["llama"], 0, drafter, batch=4).run(prompts[:2], [params, once])
    engine = engine_for(tiny_dirs["llama"], 400, drafter, batch=4)
    engine.model = CountingPacked(engine.model)
    a = engine.add_request(prompts[0], params)
    got: dict[str, list] = {}
    for o in engine.step():
        got.setdefault(o.request_id, []).append(o)
    b = engine.add_request(prompts[1], once)
    bad = [engine.add_request([7, 7] + prompts[2][2:], params) for _ in range(2)]  # the same prompt: the second reuses the first's prefill
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert [[(o.finished, o.finish_reason.value, o.new_token_ids) for o in got[i]] for i in bad] == [[(True, "abort", [])]] * 2
    assert [t for o in got[b] for t in o.new_token_ids] == want[1].output_ids and len(want[1].output_ids) == 1
    assert [t for o in got[a] for t in o.new_token_ids] == want[0].output_ids
