"""Replay gives the live engine's acceptance exactly (greedy), for the same drafter weights."""
from dataclasses import replace

import pytest
import torch

from tandem.config import SamplingParams
from tandem.flywheel.objective import Lookup
from tandem.flywheel.replay import generated_roots, replay_request, replay_trace, target_traces, trace_example
from tandem.models.eagle import EagleConfig, save_eagle
from tandem.training.offline import TrainConfig, build_examples, eagle_logits, train_head

NEAR_TIE = 1e-3  # top-2 logit gap under which the head's float noise (attention blocking) may pick either token

from flywheel_helpers import eagle_engine, make_prompts


@pytest.fixture(scope="module")
def trained_head_dir(target, tmp_path_factory):
    prompts = make_prompts(12, seed=7)
    examples = build_examples(target, prompts, 40, EagleConfig.for_target(target.cfg).taps)
    head, _ = train_head(TrainConfig(steps=80, draft_vocab=200, lr=3e-3, holdout=0.0), target, examples)
    return save_eagle(head, tmp_path_factory.mktemp("head"))


def test_replay_matches_live_acceptance(target, trained_head_dir, tmp_path):
    """Per step: the same pending position, draft length and accepted count, and a rejection at the same root
    and depth with the same token, as the live engine's trace of the same request; the token may differ only
    where the head's two best logits are within NEAR_TIE (the unroll and the cached draft steps attend in
    different blocks: float noise at a tie), and rarely."""
    from tandem.flywheel.traces import TraceCollector

    prompts = make_prompts(10, seed=11)
    budgets = [40, 17, 40, 5, 40, 33, 2, 40, 12, 40]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in budgets]
    engine = eagle_engine(target, drafter_path=trained_head_dir)
    live_traces = []
    collector = TraceCollector(live_traces.append)
    engine.observers.append(collector)
    live = engine.run(prompts, params)
    collector.flush()
    collector.close()
    live_traces = {t.request_id: t for t in live_traces}
    assert engine.stats.accepted_tokens > 0  # a head that accepts something, or the test proves little
    taps = EagleConfig.for_target(target.cfg).taps
    traces = target_traces(target, {str(i): p for i, p in enumerate(prompts)}, 40, taps, cache=tmp_path)
    cached = target_traces(target, {str(i): p for i, p in enumerate(prompts)}, 40, taps, cache=tmp_path)
    assert cached.keys() == traces.keys()
    rejected = near_ties = 0
    for i, (request, budget) in enumerate(zip(live, budgets)):
        trace = served_part(traces[str(i)], len(prompts[i]), budget)
        assert trace.tokens[len(prompts[i]):].tolist() == request.output_ids
        result = replay_request(engine.drafter.head, trace, 4, budget)
        recorded = live_traces[request.request_id]
        assert result.steps == list(zip(recorded.step_root.tolist(), recorded.step_drafted.tolist(), recorded.step_accepted.tolist()))
        live_rejections = list(zip(recorded.reject_root.tolist(), recorded.reject_depth.tolist(), recorded.reject_token.tolist()))
        assert [r[:2] for r in result.rejections] == [r[:2] for r in live_rejections]
        for (root, depth, token), (_, _, live_token) in zip(result.rejections, live_rejections):
            assert token == live_token or _top2_gap(engine.drafter.head, trace, root, depth) < NEAR_TIE, (i, root, depth)
            near_ties += token != live_token
        assert len(result.steps) == request.metrics.steps and result.acceptance_length == pytest.approx(request.metrics.acceptance_length)
        rejected += len(result.rejections)
        replayed = replay_trace(trace, result, version=3)
        assert replayed.step_version.tolist() == [3] * len(result.steps)
        assert replayed.reject_token.tolist() == [t for _, _, t in result.rejections]
        assert int(replayed.node_accepted.sum()) == sum(a for _, _, a in result.steps) and int((~replayed.node_accepted).sum()) == len(result.rejections)
    assert rejected > 0 and near_ties <= max(1, rejected // 20)


def test_replay_of_the_deployed_drafter_matches_a_live_eagle_ngram_engine(target, trained_head_dir, tmp_path):
    """With a Lookup, the replay also gives the steps of the drafter as deployed (the head's full chain with the
    prompt-lookup branch grafted on): the same pending positions, nodes drafted and accepted counts as a live
    `eagle_ngram` engine (full chains) serving the same requests, on prompts with repeats (so the branch matters)."""
    from tandem.config import EngineConfig
    from tandem.drafters import build_drafter
    from tandem.engine.engine import Engine
    from tandem.flywheel.traces import TraceCollector
    from tiny_helpers import repetitive_prompts

    prompts = repetitive_prompts(6, seed=5) + make_prompts(2, seed=12)
    budgets = [40, 23, 40, 9, 40, 31, 40, 17]
    drafter = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=4, max_len=256, draft_vocab_size=200,
                            drafter_path=trained_head_dir, min_confidence=0.0)
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=256, record_steps=True), drafter=drafter)
    live_traces = []
    collector = TraceCollector(live_traces.append)
    engine.observers.append(collector)
    live = engine.run(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in budgets])
    collector.flush()
    collector.close()
    recorded = {t.request_id: t for t in live_traces}
    traces = target_traces(target, {str(i): p for i, p in enumerate(prompts)}, 40, EagleConfig.for_target(target.cfg).taps, cache=tmp_path)
    grafted = better = 0
    for i, (request, budget) in enumerate(zip(live, budgets)):
        trace = served_part(traces[str(i)], len(prompts[i]), budget)
        result = replay_request(drafter.eagle.head, trace, 4, budget, Lookup(k=4))
        live_steps = list(zip(recorded[request.request_id].step_root.tolist(), recorded[request.request_id].step_drafted.tolist(),
                              recorded[request.request_id].step_accepted.tolist()))
        assert result.deployed == live_steps, i
        assert result.deployed_acceptance_length == pytest.approx(request.metrics.acceptance_length)
        grafted += sum(drafted > min(4, max(0, budget - 1)) for _, drafted, _ in result.deployed)  # steps with a lookup branch beside the chain
        better += result.deployed_acceptance_length > result.acceptance_length
    assert grafted > 0 and better > 0  # the branch was grafted and it paid somewhere: the comparison has power


def served_part(trace, prompt_len: int, budget: int):
    """The cached target trace (40 new tokens) cut to what a request of max_tokens `budget` serves."""
    length = prompt_len + min(budget, len(trace.tokens) - prompt_len)
    generated = max(0, length - 1 - prompt_len)
    return replace(trace, tokens=trace.tokens[:length], features=trace.features[: length - 1], final_hidden=trace.final_hidden[:generated])


@torch.inference_mode()
def _top2_gap(head, trace, root: int, depth: int) -> float:
    """Gap between the two best draft logits the replay saw at this root and depth."""
    roots = generated_roots(trace)
    logits, _ = eagle_logits(head, [trace_example(trace)], depth + 1, roots, roots)
    top = logits[depth][0, root - int(roots[0])].topk(2).values
    return float(top[0] - top[1])


def test_target_traces_are_cached_a_shard_per_group_of_prompts(target, tmp_path):
    """One shard per shard_prompts prompts generated (an interrupted run keeps its finished shards); a later call
    generates only the prompts no shard holds, and the cached traces equal fresh ones."""
    taps = EagleConfig.for_target(target.cfg).taps
    prompts = {str(i): p for i, p in enumerate(make_prompts(6, seed=5))}
    first = target_traces(target, dict(list(prompts.items())[:5]), 8, taps, cache=tmp_path, shard_prompts=2)
    assert len(list(tmp_path.glob("traces-*.parquet"))) == 3 and set(first) == {"0", "1", "2", "3", "4"}
    every = target_traces(target, prompts, 8, taps, cache=tmp_path, shard_prompts=2)
    assert len(list(tmp_path.glob("traces-*.parquet"))) == 4 and set(every) == set(prompts)
    for key, trace in first.items():
        assert torch.equal(every[key].tokens, trace.tokens) and torch.equal(every[key].features.float(), trace.features.float())


def test_two_fillers_with_disjoint_prompts_fill_one_cache(target, tmp_path):
    """`bench aurora --jobs N` fills the cache from N processes, each with every N-th missing prompt: together they
    generate each trace once, and cached_trace_ids reads back exactly the keys filled."""
    from tandem.flywheel.replay import cached_trace_ids, fill_trace_cache

    taps = EagleConfig.for_target(target.cfg).taps
    prompts = {str(i): p for i, p in enumerate(make_prompts(5, seed=6))}
    keys = list(prompts)
    assert fill_trace_cache(target, {k: prompts[k] for k in keys[0::2]}, 8, taps, tmp_path) == 3
    assert cached_trace_ids(tmp_path) == {"0", "2", "4"}
    assert fill_trace_cache(target, prompts, 8, taps, tmp_path) == 2  # only the two no shard holds
    assert fill_trace_cache(target, prompts, 8, taps, tmp_path) == 0
    assert cached_trace_ids(tmp_path) == set(prompts) and len(list(tmp_path.glob("traces-*.parquet"))) == 2
