"""`tandem bench trainer-step`: trainer steps timed on served traces, with and without the branch term."""
import pytest

from tandem.bench.flywheel.trainer_step import TrainerStepConfig, run_trainer_step_bench, time_steps
from tandem.errors import InvalidParameterError
from tandem.flywheel.trainer import FlywheelConfig


def test_time_steps_times_the_requested_steps_on_recorded_traces(tiny_llama):
    """Traces recorded the bench's way (a frozen flywheel serving a stream), then timed steps over them."""
    from tandem.config import SamplingParams
    from tandem.flywheel.setups import FlywheelSetup, live_engine, scratch_head, serve_stream

    from tiny_helpers import load_packed, make_prompts

    target = load_packed(tiny_llama)
    head = scratch_head(target, 200)
    engine, flywheel = live_engine("static", target, {"static": head}, FlywheelSetup(), batch=2, max_len=256, record=True)
    serve_stream(engine, flywheel, [(p, "code") for p in make_prompts(3, seed=4)], SamplingParams(max_tokens=12, temperature=0.0), 2)
    flywheel.close()
    traces = flywheel.buffer.snapshot()
    assert len(traces) == 3 and any(len(t.branch_token) for t in traces)  # live traces carry branch nodes, the term the bench splits out
    seconds, reads = time_steps(target, head, traces, FlywheelConfig(batch_size=2), steps=3)
    assert len(seconds) == 3 and all(isinstance(s, float) and s > 0 for s in seconds)
    # the scratch head trains its 200-row fp32 LM head: read by the forward, the input gradient and the optimiser's update
    assert reads["lm_head"] == 3 * 200 * target.cfg.hidden_size * 4


def test_bad_configs_are_refused():
    with pytest.raises(InvalidParameterError):
        TrainerStepConfig(steps=0)
    with pytest.raises(InvalidParameterError):
        TrainerStepConfig(domains=())


@pytest.mark.slow
def test_trainer_step_bench_on_smollm2_with_the_shipped_head():
    report = run_trainer_step_bench(TrainerStepConfig(requests=4, max_tokens=16, steps=1, batch_size=2))
    assert report["traces"] == 4 and report["branch_nodes_per_trace"] > 0
    assert set(report["step_s"]) == {"full", "no_branch"} and [len(v) for v in report["steps_s"].values()] == [1, 1]
