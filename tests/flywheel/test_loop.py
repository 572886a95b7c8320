"""The whole flywheel on a tiny model: serve, collect, train in the background, hot-swap, restart."""
import pytest

from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.flywheel.loop import Flywheel, FlywheelOptions
from tandem.flywheel.trainer import FlywheelConfig, wait_for

from flywheel_helpers import GREEDY, eagle_engine, make_prompts, plain_outputs, serve, serve_past_a_publish


def test_flywheel_trains_swaps_and_stays_lossless(target, tmp_path):
    options = FlywheelOptions(loss=FlywheelConfig(publish_every=2, min_traces=2), spill_dir=str(tmp_path / "traces"),
                              checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, window=4)
    flywheel = Flywheel(eagle_engine(target), target, options).start()
    serve_past_a_publish(flywheel, target)
    flywheel.close()
    metrics = flywheel.metrics()
    assert metrics["trainer"]["error"] is None  # the counts under a background trainer are pinned in the test below
    assert metrics["buffer"]["added"] == 8 and metrics["collector_dropped_records"] == 0
    assert metrics["median_step_s"] > 0
    timed = [r["seconds"] for r in flywheel.trainer.losses]
    assert len(timed) == flywheel.trainer.steps and metrics["trainer"]["step_s"] == round(sum(timed) / len(timed), 4)
    assert metrics["max_step_s"] == round(max(flywheel.step_times), 4) >= metrics["max_swap_step_s"]
    steps = flywheel.trainer.steps
    assert flywheel.trainer.published == steps // 2  # versions 1, 2, ...: one every publish_every = 2 steps

    # restart: the trainer resumes from its checkpoint, the buffer from the spilled traces
    again = Flywheel(eagle_engine(target), target, options)
    assert again.trainer.steps == steps
    assert again.restored_traces == 8 and len(again.buffer) == 8
    again.close()


def test_each_published_version_is_swapped_in_at_a_step_boundary(target):
    """The trainer stepped by hand (no thread), so the counts are exact: 2 steps publish version 1, which serving
    swaps in (validated in the background, so within a few steps); 2 more publish version 2, swapped in once
    version 1 has passed its watch window of 4 request-steps. Greedy outputs stay those of plain decoding."""
    options = FlywheelOptions(loss=FlywheelConfig(publish_every=2, min_traces=2), window=4)
    flywheel = Flywheel(eagle_engine(target), target, options)
    served = serve(flywheel, make_prompts(4, seed=5), GREEDY)
    for version in (1, 2):
        assert wait_for(lambda: len(flywheel.buffer) >= 2, timeout=30)  # the collector thread files the traces (min_traces 2)
        flywheel.trainer.train_step()
        flywheel.trainer.train_step()
        assert flywheel.trainer.published == version
        for seed in range(10, 30):  # a few requests: the background validation finishes within a step or two
            served += serve(flywheel, make_prompts(1, seed=seed), GREEDY)
            if flywheel.engine.drafter.version == version:
                break
    flywheel.close()
    stats = flywheel.swapper.stats
    assert (flywheel.trainer.steps, stats.swaps, stats.refused, stats.rollbacks) == (4, 2, 0, 0)
    assert [(e["kind"], e["version"], e["from"]) for e in stats.events] == [("swap", 1, 0), ("swap", 2, 1)]
    prompts = [r.prompt_ids for r in served]
    assert [r.output_ids for r in served] == plain_outputs(target, prompts, [GREEDY] * len(prompts))


def test_flywheel_refuses_an_engine_it_cannot_train(target):
    with pytest.raises(InvalidParameterError, match="record_steps"):
        Flywheel(eagle_engine(target, record=False), target)


def test_sampled_requests_feed_the_trainer_too(target):
    flywheel = Flywheel(eagle_engine(target), target, FlywheelOptions(train=False))
    serve(flywheel, make_prompts(2, seed=8), SamplingParams(max_tokens=16, temperature=0.8, seed=1))
    flywheel.close()
    trace = flywheel.buffer.sample(1, __import__("random").Random(0))[0]
    assert len(trace.reject_weight) and float(trace.reject_weight.min()) >= 0.0 and float(trace.reject_weight.max()) <= 1.0
    assert trace.sampling == (0.8, 0, 1.0)  # the discard term recomputes the drafting distribution from these


def test_a_checkpoint_that_cannot_be_read_stops_the_start(target, tmp_path):
    """A restart from a damaged checkpoint directory is an error, never a silent fresh trainer."""
    from tandem.errors import TandemError

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "LATEST").write_text("step-00000010-1\n")  # points at a checkpoint that is not there
    with pytest.raises(TandemError, match="no trainer checkpoint"):
        Flywheel(eagle_engine(target), target, FlywheelOptions(checkpoint_dir=str(tmp_path / "ckpt")))
    fresh = Flywheel(eagle_engine(target), target, FlywheelOptions(checkpoint_dir=str(tmp_path / "empty")))
    assert fresh.trainer.steps == 0  # no directory at all: a first start
    fresh.close()


def test_step_statistics_stay_bounded(target):
    from tandem.flywheel.loop import STEP_WINDOW

    flywheel = Flywheel(eagle_engine(target), target, FlywheelOptions(train=False))
    for _ in range(STEP_WINDOW + 100):
        flywheel.step()  # nothing to serve: a cheap step, still timed
    assert len(flywheel.step_times) == STEP_WINDOW and flywheel.metrics()["median_step_s"] is not None
    flywheel.close()
