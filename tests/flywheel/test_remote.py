"""The trainer in a child process: same behaviour and metrics as the thread, nothing left behind."""
import multiprocessing as mp
import os
import signal
import tempfile

import pytest

from tandem.config import SamplingParams
from tandem.errors import TandemError
from tandem.flywheel.loop import Flywheel, FlywheelOptions
from tandem.flywheel.remote import ChildConfig
from tandem.flywheel.trainer import FlywheelConfig, wait_for

from flywheel_helpers import eagle_engine, serve_past_a_publish, make_prompts, plain_outputs, serve

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # short: every test here also starts a process


def process_options(**options) -> FlywheelOptions:
    loss = options.pop("loss", FlywheelConfig(publish_every=2, min_traces=2))
    return FlywheelOptions(loss=loss, trainer_process=True, **options)


@pytest.fixture
def spawn(target):
    """Process-mode flywheels whose children end at teardown even when the test failed half way."""
    made = []

    def build(options):
        made.append(Flywheel(eagle_engine(target), target, options))
        return made[-1]

    yield build
    for flywheel in made:
        flywheel.trainer.close()  # idempotent: a no-op after the test's own close


def assert_nothing_left(flywheel):
    assert not flywheel.trainer.process.is_alive() and mp.active_children() == []
    assert not flywheel.trainer.workdir.exists()


def test_the_childs_settings_cross_as_json():
    config = ChildConfig(FlywheelConfig(lr=2e-3, discard_weight=0.0), 1 << 20, "drop_oldest", None, "/ckpt", 2, first_version=3)
    assert ChildConfig.from_json(config.to_json()) == config


def test_a_trainer_process_trains_publishes_and_serving_stays_lossless(target, tmp_path, spawn):
    options = process_options(spill_dir=str(tmp_path / "traces"), window=4)
    flywheel = spawn(options).start()
    assert flywheel.buffer is flywheel.trainer and flywheel.trainer.alive and flywheel.swapper.on_rollback == flywheel.trainer.request_restore
    serve_past_a_publish(flywheel, target)
    flywheel.close()
    metrics = flywheel.metrics()
    in_thread_flywheel = Flywheel(eagle_engine(target), target, FlywheelOptions())  # never started: the same keys
    in_thread = in_thread_flywheel.metrics()
    in_thread_flywheel.close()
    assert metrics.keys() == in_thread.keys() and metrics["trainer"].keys() == in_thread["trainer"].keys()
    assert metrics["buffer"].keys() == in_thread["buffer"].keys()
    assert metrics["swaps"]["swaps"] >= 1 and metrics["trainer"]["steps"] >= 2 and metrics["trainer"]["error"] is None
    assert metrics["buffer"]["added"] == metrics["buffer"]["spilled"] == 8 and metrics["trainer"]["last"]["step"] == metrics["trainer"]["steps"]
    assert flywheel.trainer.published == flywheel.trainer.steps // 2 and not metrics["trainer"]["alive"]
    assert_nothing_left(flywheel)


def test_a_rollback_reaches_the_child_and_a_checkpoint_resumes(target, tmp_path, spawn):
    options = process_options(loss=FlywheelConfig(publish_every=1, min_traces=2), checkpoint_dir=str(tmp_path / "ckpt"), window=200)
    flywheel = spawn(options).start()
    serve(flywheel, make_prompts(4, seed=5), GREEDY)
    assert wait_for(lambda: flywheel.trainer.published is not None, timeout=60)
    engine, swapper = flywheel.engine, flywheel.swapper
    for prompt in make_prompts(4, seed=6):  # serve until a version is adopted (and watched: the window is long)
        engine.add_request(prompt, GREEDY)
    assert wait_for(lambda: flywheel.step() is not None and swapper.stats.swaps == 1, timeout=60, poll=0)
    swapper.observe_lengths(swapper.stats.version, [0] * options.window)  # a collapse: the next step rolls back
    while engine.has_unfinished():
        flywheel.step()
    assert swapper.stats.alarms == swapper.stats.rollbacks == 1
    assert wait_for(lambda: flywheel.trainer.restores == 1, timeout=60)  # applied at the child's next step
    assert wait_for(lambda: (v := flywheel.store.latest()) is not None and v.meta["restores"] == 1, timeout=60)
    serve(flywheel, make_prompts(2, seed=7), GREEDY)
    assert swapper.stats.swaps == 2  # a version trained from the good weights is adopted again
    flywheel.close()
    steps = flywheel.trainer.steps
    assert_nothing_left(flywheel)

    again = spawn(options)
    assert again.trainer.resumed_from_step == again.trainer.steps == steps and again.trainer.restores == 1
    assert wait_for(lambda: (v := again.store.latest()) is not None and v.meta["trainer_step"] == steps, timeout=30)  # published at once
    again.close()
    assert_nothing_left(again)


def test_a_crashed_or_killed_child_leaves_serving_on_the_last_weights(target, spawn):
    """lr = 1e30 explodes the weights in one step: the second step's loss is not finite and the trainer stops."""
    options = process_options(loss=FlywheelConfig(lr=1e30, warmup=1, publish_every=1000, min_traces=1))
    flywheel = spawn(options).start()
    serve(flywheel, make_prompts(2, seed=5), GREEDY)
    assert wait_for(lambda: flywheel.trainer.error is not None, timeout=60)
    assert "non-finite" in str(flywheel.trainer.error) and not flywheel.trainer.alive and flywheel.trainer.process.is_alive()
    prompts = make_prompts(3, seed=4)
    assert [r.output_ids for r in serve(flywheel, prompts, GREEDY)] == plain_outputs(target, prompts, [GREEDY] * 3)
    assert flywheel.engine.drafter.version == 0 and flywheel.metrics()["trainer"]["error"] is not None

    os.kill(flywheel.trainer.process.pid, signal.SIGKILL)  # the whole child goes: serving still goes on
    assert wait_for(lambda: not flywheel.trainer.process.is_alive(), timeout=10)
    assert [r.output_ids for r in serve(flywheel, prompts, GREEDY)] == plain_outputs(target, prompts, [GREEDY] * 3)
    flywheel.close()
    assert_nothing_left(flywheel)


def test_a_checkpoint_that_cannot_be_read_stops_the_start(target, tmp_path, monkeypatch):
    """As in the thread mode: an error, never a silent fresh trainer; and the failed start leaves nothing."""
    import tandem.flywheel.remote as remote

    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(remote.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw, dir=tmp_path)) or made[-1])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "LATEST").write_text("step-00000010-1\n")
    with pytest.raises(TandemError, match="no trainer checkpoint"):
        Flywheel(eagle_engine(target), target, process_options(checkpoint_dir=str(tmp_path / "ckpt")))
    assert len(made) == 1 and not os.path.exists(made[0]) and mp.active_children() == []


def test_the_child_trains_on_the_cores_it_is_given(target, spawn):
    """A core of its own (FlywheelOptions.trainer_cpus): the child pins itself before its threads start; a core
    outside this machine's set stops the start with the reason."""
    core = max(os.sched_getaffinity(0))
    flywheel = spawn(process_options(trainer_cpus=(core,)))
    assert os.sched_getaffinity(flywheel.trainer.process.pid) == {core}
    flywheel.close()
    assert ChildConfig.from_json(flywheel.trainer.config.to_json()).cpus == (core,)
    with pytest.raises(TandemError, match="could not start: OSError"):
        Flywheel(eagle_engine(target), target, process_options(trainer_cpus=(4095,)))
    assert mp.active_children() == []
