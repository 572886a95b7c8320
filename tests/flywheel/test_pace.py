"""The trainer's pace: the steps one core affords (CoreBudget), and rest once a round of steps buys too little (LossPacer)."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.flywheel.pace import CoreBudget, LossPacer, PaceConfig


def steps_taken(budget: CoreBudget, serve_s: float, step_s: float) -> int:
    budget.earn(serve_s)
    taken = 0
    while budget.affords():
        budget.spend(step_s)
        taken += 1
    return taken


def test_the_core_budget_steps_while_serving_paid_for_the_time():
    """0.65 s of serving a request against 0.44 s steps (BENCHMARKS 10's 3,000-request replay): 1.48 steps a request
    over time, never more than the core had, overruns repaid by the next request."""
    budget = CoreBudget()
    taken = [steps_taken(budget, 0.65, 0.44) for _ in range(4)]
    assert taken == [2, 1, 2, 1] and budget.spent == pytest.approx(6 * 0.44) and budget.credit == pytest.approx(4 * 0.65 - 6 * 0.44)
    assert steps_taken(CoreBudget(cores=2.0), 0.65, 0.44) == 3  # two trainer cores earn twice the time
    idle = CoreBudget()
    idle.earn(5.0)
    idle.idle()  # nothing to train on: the core's time is gone, not banked
    assert not idle.affords() and steps_taken(idle, 0.5, 0.44) == 2  # from then on it earns afresh
    with pytest.raises(InvalidParameterError):
        CoreBudget(cores=0.0)


def test_a_round_that_buys_less_than_the_margin_ends_in_a_rest_until_fresh_traces():
    """A fake loss sequence: rounds of 2 steps, each between two probes of the same newest traces."""
    pacer = LossPacer(PaceConfig(margin=0.05, steps_per_round=2, fresh=3))
    log = []

    def run(added: int, losses: list[float]) -> None:
        """Probe while asked (taking losses in order), then record whether a step may follow and take it."""
        while pacer.wants_probe(added):
            pacer.probe(losses.pop(0), added)
        log.append(pacer.may_step())
        if log[-1]:
            pacer.stepped()

    losses = [4.0, 3.0, 3.0, 2.9, 3.5, 3.0]
    run(10, losses)  # probe 4.0: step 1 of round 1
    run(10, losses)  # step 2
    run(10, losses)  # end probe 3.0 (gain 0.25): round 2 starts at 3.0, step 1
    run(10, losses)  # step 2
    run(11, losses)  # end probe 2.9 (gain 0.033 < 0.05): rest
    run(13, losses)  # 2 fresh traces since the rest: still resting
    run(14, losses)  # 3 fresh: round 3 probes the newest, 3.5, and steps
    assert log == [True, True, True, True, False, False, True] and losses == [3.0]
    assert (pacer.rounds, pacer.rests, pacer.state) == (2, 1, "stepping")
    with pytest.raises(InvalidParameterError):
        PaceConfig(steps_per_round=0)


def test_a_paced_trainer_rests_when_its_newest_traces_are_learnt(target):
    """On a buffer of 4 traces that never changes, the trainer memorises them: once a round lowers their loss by
    less than a (large) margin it takes no step, until new traces arrive."""
    from tandem.flywheel.buffer import TraceBuffer
    from tandem.flywheel.setups import scratch_head
    from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
    from tandem.flywheel.weights import WeightStore

    from flywheel_helpers import eagle_engine, served_traces

    traces = served_traces(target, n=5, seed=1, engine=eagle_engine(target, batch=2))
    head = scratch_head(target, 200)
    buffer = TraceBuffer()
    for trace in traces[:4]:
        buffer.put(trace)
    cfg = FlywheelConfig(batch_size=2, lr=1e-3, warmup=1, publish_every=100, pace_margin=0.9, min_traces=1)
    trainer = OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), buffer, WeightStore(), cfg)
    records = [trainer.train_step() for _ in range(30)]
    taken = sum(r is not None for r in records)
    assert trainer.pacer.rests == 1 and taken == trainer.pacer.cfg.steps_per_round and records[taken:] == [None] * (30 - taken)
    for trace in traces[4:] * 4:  # fresh traces (4 = PaceConfig.fresh): a new round probes them and steps
        buffer.put(trace)
    assert trainer.train_step() is not None and trainer.pacer.state == "stepping"
