"""The flywheel's serving set-ups on a tiny model: replay with training, live serving of a stream, plain decoding."""
import os

import pytest

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.flywheel.replay import replay_request, target_traces
from tandem.flywheel.setups import (MODES, FlywheelSetup, ReplayFlywheel, check_modes, core_split, live_engine, live_options, pinned, scratch_head, serve_stream,
                                    serving_cores)
from tandem.models.eagle import EagleConfig

from flywheel_helpers import make_prompts, plain_outputs


@pytest.fixture(scope="module")
def heads(target):
    return {"scratch": scratch_head(target, 200, seed=0)}


def test_replay_flywheel_trains_publishes_and_serves_each_version(target, heads):
    prompts = {str(i): p for i, p in enumerate(make_prompts(6, seed=2))}
    traces = target_traces(target, prompts, 16, EagleConfig.for_target(target.cfg).taps)
    setup = FlywheelSetup(publish_every=2, seed=0, steps_per_request=1.0, shift_detect=False)
    frozen = ReplayFlywheel("scratch", target, heads, setup)
    online = ReplayFlywheel("online_scratch", target, heads, setup)
    assert online.swapper.on_rollback == online.trainer.request_restore  # a rollback reaches the trainer
    versions = []
    for key, trace in traces.items():
        result, version = frozen.serve(trace, 16)
        assert result.steps == replay_request(frozen.served, trace, 4, 16).steps and version == 0
        versions.append(online.serve(trace, 16)[1])
    assert frozen.metrics() == {} and online.metrics()["trainer_steps"] == 5  # none after the first: min_traces = 2
    # each request is scored by the version in place when it arrives, then trained on: steps after requests 2..6,
    # version 1 published by step 2 (after request 3) and swapped in at once; version 2 (step 4) waits, since version 1
    # has not yet been watched over its window of 64 request-steps
    assert online.trainer.published == 2 and versions == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("mode,adaptive_k,process", [("plain", False, False), ("online_scratch", False, False), ("online_scratch", True, False),
                                                    ("online_scratch", False, True)])
def test_live_serving_of_a_stream_is_lossless(target, heads, mode, adaptive_k, process):
    from tandem.engine.control import SpeculationController
    from tandem.flywheel.remote import TrainerProcess

    prompts = make_prompts(5, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    setup = FlywheelSetup(publish_every=1, watch_window=4, trainer_duty=0.5, adaptive_k=adaptive_k, trainer_process=process)
    engine, flywheel = live_engine(mode, target, heads, setup, batch=2, max_len=256)
    assert (flywheel is None) == (mode == "plain") and (flywheel is None or flywheel.options.trainer_duty == 0.5)
    assert isinstance(flywheel and flywheel.trainer, TrainerProcess) == process
    assert isinstance(engine.draft_policy, SpeculationController) == adaptive_k
    seen = []
    result = serve_stream(engine, flywheel, [(p, "code" if i < 3 else "sql") for i, p in enumerate(prompts)], params, 2, on_finish=seen.append)
    if flywheel is not None:
        flywheel.close()
    expected = plain_outputs(target, prompts, [params] * 5)
    assert [r["i"] for r in result.rows] == list(range(5)) and len(seen) == 5
    assert [r["domain"] for r in result.rows] == ["code"] * 3 + ["sql"] * 2
    assert result.outputs == expected and result.output_tokens == sum(len(o) for o in expected) and result.seconds > 0
    if mode == "plain":
        assert all(r["acceptance_length"] == 1.0 and r["version"] == 0 for r in result.rows)
    if adaptive_k:
        assert engine.draft_policy.metrics()["steps"] > 0  # the controller decided the steps


def test_a_trained_head_is_fine_tuned_gently_and_anchored_a_day0_head_is_not(target, heads):
    setup = FlywheelSetup(lr=1e-3, finetune_lr=1e-4, anchor=50.0)
    assert (setup.loss({}, "static").lr, setup.loss({}, "static").anchor) == (1e-4, 50.0)
    assert (setup.loss({}, "scratch").lr, setup.loss({}, "scratch").anchor) == (1e-3, 0.0)
    online = ReplayFlywheel("online", target, {"static": heads["scratch"]}, setup, serve_seconds=len)  # the "static" slot: a trained head
    scratch = ReplayFlywheel("online_scratch", target, heads, setup, serve_seconds=len)
    assert (online.trainer.cfg.lr, online.trainer.cfg.anchor, scratch.trainer.cfg.lr, scratch.trainer.cfg.anchor) == (1e-4, 50.0, 1e-3, 0.0)
    assert online.trainer.anchor is not None and scratch.trainer.anchor is None
    mixed = FlywheelSetup(sample="domains", recent_share=0.5, recent_window=16).loss({}, "static")
    assert (mixed.sample, mixed.recent_share, mixed.recent_window) == ("domains", 0.5, 16)


def test_unknown_modes_and_replaying_plain_are_refused(target, heads):
    with pytest.raises(InvalidParameterError, match="telepathy"):
        check_modes(["static", "telepathy"])
    with pytest.raises(InvalidParameterError, match="trainer_duty"):
        FlywheelSetup(trainer_duty=1.5)
    with pytest.raises(InvalidParameterError, match="no drafter"):
        ReplayFlywheel("plain", target, heads, FlywheelSetup())
    assert MODES["plain"] == (None, None) and MODES["online"] == ("static", {})


def test_the_trainer_gets_the_highest_core_and_serving_the_rest():
    assert core_split({0, 1}) == ((0,), (1,))
    assert core_split({7, 2, 5}) == ((2, 5), (7,))
    assert core_split({3}) is None  # one core: nothing to split


def test_pinned_runs_a_block_on_the_given_cores_and_restores_the_mask():
    before = os.sched_getaffinity(0)
    core = min(before)
    with pinned((core,)):
        assert os.sched_getaffinity(0) == {core}
        assert core_split() == core_split(before)  # the split is of the cores the process started with
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before


def test_live_options_give_the_trainer_process_its_own_core():
    split = core_split()
    options = live_options(FlywheelSetup(trainer_process=True, trainer_core=True), "static", {})
    assert options.trainer_cpus == (split[1] if split else None)
    assert serving_cores(FlywheelSetup(trainer_process=True, trainer_core=True)) == (split[0] if split else None)
    assert live_options(FlywheelSetup(trainer_process=True), "static", {}).trainer_cpus is None  # off by default
    assert live_options(FlywheelSetup(trainer_core=True), "static", {}).trainer_cpus is None  # a thread cannot be pinned apart


def test_a_trained_head_serves_with_the_confidence_cut_a_day0_head_drafts_full_chains(target, heads):
    """live_engine gives the cut to modes starting from a trained head only, and grafts the prompt-lookup branch on
    every drafting mode when asked; bench shift's live runs default to the cut every trained head is served with."""
    from tandem.bench.flywheel.shift import ShiftConfig
    from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
    from tandem.drafters.hybrid import EagleNgramDrafter

    assert ShiftConfig().setup.min_confidence == TRAINED_MIN_CONFIDENCE and not ShiftConfig().setup.prompt_lookup
    setup = FlywheelSetup(min_confidence=0.3, prompt_lookup=True)
    served = {"static": heads["scratch"], "scratch": heads["scratch"]}
    for mode, cut in (("static", 0.3), ("online_scratch", 0.0)):
        engine, flywheel = live_engine(mode, target, served, setup, batch=1, max_len=64)
        assert isinstance(engine.drafter, EagleNgramDrafter) and engine.drafter.eagle.min_confidence == cut
        if flywheel is not None:
            flywheel.close()


@pytest.mark.parametrize("mode", ["static", "scratch"])
def test_a_frozen_mode_serves_bare_as_a_user_runs_it(target, heads, mode):
    """The live baseline records nothing: no step records, no observers (trace collector, hot-swapper), no flywheel;
    record=True is the frozen flywheel that only collects traces (bench trainer-step)."""
    served = {"static": heads["scratch"], "scratch": heads["scratch"]}
    engine, flywheel = live_engine(mode, target, served, FlywheelSetup(prompt_lookup=True), batch=2, max_len=64)
    assert flywheel is None and engine.config.record_steps is False and engine.observers == [] and engine.drafter is not None
    recording, frozen = live_engine(mode, target, served, FlywheelSetup(), batch=2, max_len=64, record=True)
    assert recording.config.record_steps is True and frozen.trainer is None and frozen.collector in recording.observers
    frozen.close()
