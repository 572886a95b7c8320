"""The flywheel around a running engine: collector -> buffer -> trainer thread -> store -> hot-swapper.

Composition lives here, outside the engine (which knows only observers and between-steps hooks) and
outside the trainer (which knows only the buffer and the store). `Flywheel.step()` is `engine.step()`
with its wall time recorded and swap steps marked, so the stall a swap causes is measurable. With
`trainer_process` the buffer and the trainer live in a child process (tandem.flywheel.remote) behind the
same names (`TraceSink`, `Trainer`, a WeightStore), so everything here runs the same code in both modes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import BufferStats, TraceBuffer, refill
from tandem.flywheel.remote import ChildConfig, TrainerProcess
from tandem.flywheel.trainer import FlywheelConfig, resume_or_start
from tandem.flywheel.traces import SequenceTrace, TraceCollector
from tandem.flywheel.weights import HotSwapper, WeightStore, WeightVersion


STEP_WINDOW = 4096  # step times kept for the median / max (the newest)


class TraceSink(Protocol):
    """Where the collector puts finished traces: TraceBuffer, or the child's, seen through TrainerProcess."""

    def put(self, trace: SequenceTrace) -> bool: ...
    def stats(self) -> BufferStats: ...
    def __len__(self) -> int: ...
    def close(self) -> None: ...


class Trainer(Protocol):
    """What the flywheel, the admin API and the metrics use of a trainer: OnlineTrainer, or TrainerProcess."""

    steps: int
    published: int | None
    restores: int
    resumed_from_step: int | None
    losses: Sequence[dict]  # the newest last
    error: BaseException | None
    alive: bool

    def start(self, threads: int | None = 1, idle_s: float = 0.05, checkpoint_dir=None, checkpoint_every: int = 100, duty: float = 1.0): ...
    def stop(self, timeout: float = 30.0) -> None: ...
    def request_restore(self, version: WeightVersion) -> int: ...
    def save_checkpoint(self, path) -> Path: ...


@dataclass(frozen=True)
class FlywheelOptions:
    loss: FlywheelConfig = field(default_factory=FlywheelConfig)
    train: bool = True  # False: collect traces and watch acceptance, but never train (a static drafter)
    buffer_bytes: int = 256 << 20
    buffer_policy: str = "balance_domains"  # when full: evict from the domain holding the most bytes
    spill_dir: str | None = None  # Parquet shards of every trace (restart, offline training); None = no spilling
    spill_max_bytes: int | None = None  # retention: the oldest shards are deleted beyond this many bytes (None = unbounded)
    spill_max_age_s: float | None = None  # retention: shards older than this are deleted (None = kept)
    checkpoint_dir: str | None = None  # trainer checkpoints; resumed from when present
    checkpoint_every: int = 100  # trainer steps
    trainer_threads: int = 1
    trainer_process: bool = False  # train in a child process (buffer and trainer there), not a thread competing with the engine's; needs train
    trainer_duty: float = 1.0  # the trainer thread's busy share of wall time (it rests between steps below 1)
    trainer_cpus: tuple[int, ...] | None = None  # trainer_process: the child's cores (tandem.flywheel.setups.core_split); None = the parent's
    collapse_ratio: float = 0.5
    window: int = 64  # request-steps a swapped-in version is watched over
    branch_depth: int = 1  # branch nodes kept per trace: levels below the accepted path (0 = none; > 1 also keeps tapped states)


class Flywheel:
    def __init__(self, engine, target, options: FlywheelOptions = FlywheelOptions()):
        drafter = engine.drafter
        if drafter is None or not hasattr(drafter, "head"):
            raise InvalidParameterError("the flywheel trains an EAGLE head: build the engine with the eagle drafter")
        if not engine.config.record_steps:
            raise InvalidParameterError("the flywheel needs detailed step records: EngineConfig(record_steps=True)")
        self.engine, self.options = engine, options
        self.buffer: TraceSink
        self.store: WeightStore
        self.trainer: Trainer | None
        self.restored_traces: int  # traces put back into the buffer from spill_dir
        if options.train and options.trainer_process:
            self._train_in_child(target, drafter)
        else:
            self._train_in_process(target, drafter)
        self.collector = TraceCollector(self.buffer.put, branch_depth=options.branch_depth)
        engine.observers.append(self.collector)
        self.swapper = HotSwapper(drafter, self.store, options.collapse_ratio, options.window).attach(engine)
        if self.trainer is not None:  # a rollback in serving reaches the trainer: it resumes from the good weights
            self.swapper.on_rollback = self.trainer.request_restore
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)  # wall time of the newest steps
        self.swap_step_times: deque[float] = deque(maxlen=STEP_WINDOW)  # of the newest steps that began with a swap or rollback

    def _train_in_process(self, target, drafter) -> None:
        o = self.options
        self.buffer = TraceBuffer(o.buffer_bytes, o.buffer_policy, o.spill_dir, o.spill_max_bytes, o.spill_max_age_s)
        self.restored_traces = refill(self.buffer, o.spill_dir)
        self.store = WeightStore(first_version=drafter.version + 1)
        self.trainer = resume_or_start(o.checkpoint_dir, target, drafter.head, self.buffer, self.store, o.loss) if o.train else None

    def _train_in_child(self, target, drafter) -> None:
        """The buffer and the trainer in a child process; one proxy plays both roles, and its store is where
        the child's versions appear."""
        o = self.options
        config = ChildConfig(o.loss, o.buffer_bytes, o.buffer_policy, o.spill_dir, o.checkpoint_dir, o.trainer_threads, first_version=drafter.version + 1,
                             spill_max_bytes=o.spill_max_bytes, spill_max_age_s=o.spill_max_age_s, cpus=o.trainer_cpus)
        self.buffer = self.trainer = TrainerProcess(target, drafter.head, config)
        self.store, self.restored_traces = self.trainer.store, self.trainer.restored_traces

    def start(self) -> "Flywheel":
        if self.trainer is not None:
            self.trainer.start(self.options.trainer_threads, checkpoint_dir=self.options.checkpoint_dir, checkpoint_every=self.options.checkpoint_every,
                               duty=self.options.trainer_duty)
        return self

    def step(self):
        changes = self.swapper.stats.swaps + self.swapper.stats.rollbacks
        start = time.perf_counter()
        outputs = self.engine.step()
        self.step_times.append(time.perf_counter() - start)
        if self.swapper.stats.swaps + self.swapper.stats.rollbacks != changes:
            self.swap_step_times.append(self.step_times[-1])
        return outputs

    def metrics(self) -> dict:
        trainer = self.trainer
        times = sorted(self.step_times)
        swap_times = list(self.swap_step_times)
        return {
            "buffer": asdict(self.buffer.stats()), "collector_dropped_records": self.collector.dropped_records,
            "collector_aborted_traces": self.collector.assembler.aborted,
            "collector_error": repr(self.collector.error) if self.collector.error else None,
            "swaps": self.swapper.stats.as_dict(),
            "trainer": None if trainer is None else {
                "steps": trainer.steps, "alive": trainer.alive, "published": trainer.published,
                "error": repr(trainer.error) if trainer.error else None, "last": trainer.losses[-1] if trainer.losses else None,
                "step_s": _mean_step_seconds(trainer.losses)},
            "median_step_s": round(times[len(times) // 2], 4) if times else None,
            "max_swap_step_s": round(max(swap_times), 4) if swap_times else None,
            # the slowest step of all: steps that admit a request also prefill its prompt, swap or not
            "max_step_s": round(times[-1], 4) if times else None,
        }

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
            if self.options.checkpoint_dir is not None and self.trainer.error is None:
                self.trainer.save_checkpoint(self.options.checkpoint_dir)
        self.collector.flush()
        self.collector.close()
        self.buffer.close()
        self.swapper.close()


def _mean_step_seconds(losses) -> float | None:
    """Mean wall time of the newest trainer steps (their loss records; up to the last 200)."""
    times = [r["seconds"] for r in list(losses) if "seconds" in r]
    return round(sum(times) / len(times), 4) if times else None
