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
    prompts = make_prompts(10, seed=11)
    budgets = [40, 17, 40, 5, 40, 33, 2, 40, 12, 40]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in budgets]
    engine = eagle_engine(target, record=False, drafter_path=trained_head_dir)
    live = engine.run(prompts, params)
    assert engine.stats.accepted_tokens > 0  # a head that accepts something, or the test proves little
    taps = EagleConfig.for_target(target.cfg).taps
    traces = target_traces(target, {str(i): p for i, p in enumerate(prompts)}, 40, taps, cache=tmp_path)
    cached = target_traces(target, {str(i): p for i, p in enumerate(prompts)}, 40, taps, cache=tmp_path)
    assert cached.keys() == traces.keys()
    for i, (request, budget) in enumerate(zip(live, budgets)):
        trace = traces[str(i)]
        length = len(prompts[i]) + min(budget, len(trace.tokens) - len(prompts[i]))
        trace = replace(trace, tokens=trace.tokens[:length], features=trace.features[: length - 1], final_hidden=trace.final_hidden[: length - 1])
        assert trace.tokens[len(prompts[i]):].tolist() == request.output_ids
        result = replay_request(engine.drafter.head, trace, 4, budget)
        assert len(result.steps) == request.metrics.steps
        assert sum(accepted for _, _, accepted in result.steps) == request.metrics.accepted_tokens
        assert result.acceptance_length == pytest.approx(request.metrics.acceptance_length)
        replayed = replay_trace(trace, result, version=3)
        assert replayed.step_version.tolist() == [3] * len(result.steps)
        assert len(replayed.reject_root) == len(result.rejections)
