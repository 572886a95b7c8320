"""Replay gives the live engine's acceptance exactly (greedy), for the same drafter weights."""
from dataclasses import replace

import pytest

from tandem.config import SamplingParams
from tandem.flywheel.replay import replay_request, replay_trace, target_traces
from tandem.models.eagle import EagleConfig, save_eagle
from tandem.training.offline import TrainConfig, build_examples, train_head

from flywheel_helpers import eagle_engine, make_prompts


@pytest.fixture(scope="module")
def trained_head_dir(target, tmp_path_factory):
    prompts = make_prompts(12, seed=7)
    examples = build_examples(target, prompts, 40, EagleConfig.for_target(target.cfg).taps)
    head, _ = train_head(TrainConfig(steps=80, draft_vocab=200, lr=3e-3, holdout=0.0), target, examples)
    return save_eagle(head, tmp_path_factory.mktemp("head"))


def test_replay_matches_live_acceptance(target, trained_head_dir, tmp_path):
    """Per step: the same pending position, draft length and accepted count, and the same rejected token
    at the same root and depth, as the live engine's trace of the same request."""
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
    rejected = 0
    for i, (request, budget) in enumerate(zip(live, budgets)):
        trace = traces[str(i)]
        length = len(prompts[i]) + min(budget, len(trace.tokens) - len(prompts[i]))
        generated = max(0, length - 1 - len(prompts[i]))
        trace = replace(trace, tokens=trace.tokens[:length], features=trace.features[: length - 1], final_hidden=trace.final_hidden[:generated])
        assert trace.tokens[len(prompts[i]):].tolist() == request.output_ids
        result = replay_request(engine.drafter.head, trace, 4, budget)
        recorded = live_traces[request.request_id]
        assert result.steps == list(zip(recorded.step_root.tolist(), recorded.step_drafted.tolist(), recorded.step_accepted.tolist()))
        assert result.rejections == list(zip(recorded.reject_root.tolist(), recorded.reject_depth.tolist(), recorded.reject_token.tolist()))
        assert len(result.steps) == request.metrics.steps and result.acceptance_length == pytest.approx(request.metrics.acceptance_length)
        rejected += len(result.rejections)
        replayed = replay_trace(trace, result, version=3)
        assert replayed.step_version.tolist() == [3] * len(result.steps)
        assert replayed.reject_token.tolist() == recorded.reject_token.tolist()
        assert int(replayed.node_accepted.sum()) == sum(a for _, _, a in result.steps) and int((~replayed.node_accepted).sum()) == len(result.rejections)
    assert rejected > 0
