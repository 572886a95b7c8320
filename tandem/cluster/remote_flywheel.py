"""A replica's side of the flywheel when the trainer is a Ray actor: the same Flywheel, three proxies.

`RayFlywheel` is tandem.flywheel.loop.Flywheel with its buffer, store and trainer replaced by:

- `RemoteTraceSink` (TraceSink): the collector thread encodes each finished trace (`trace_to_bytes`) and
  sends it to the trainer actor; at most MAX_IN_FLIGHT are outstanding (more are dropped and counted). Each
  send's outcome is collected: `acked` (in the buffer), `refused` (the full buffer refused it), `lost` (the
  trainer died before storing it). Nothing is dropped without a count;
- `PulledWeightStore` (WeightStore): a poller thread asks the trainer actor for its newest version every
  `poll_s`, fetches that version's object (ray.put once by the trainer) and makes it `latest()`; the
  HotSwapper validates and installs it between the replica's own steps, exactly as in one process. While
  the trainer is unreachable the replica keeps the version it serves (`trainer_unreachable` counts polls);
- `TrainerView` (Trainer): the trainer's status as of the last poll; `request_restore` (a rollback in
  serving) is sent to the actor.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass

from tandem.cluster.wire import version_from_bytes, version_to_bytes
from tandem.flywheel.buffer import BufferStats
from tandem.flywheel.loop import Flywheel, FlywheelOptions
from tandem.flywheel.traces import SequenceTrace, trace_to_bytes
from tandem.flywheel.weights import WeightRefused, WeightStore, WeightVersion

MAX_IN_FLIGHT = 64
RPC_TIMEOUT_S = 10.0


@dataclass
class SinkCounts:
    sent: int = 0
    acked: int = 0
    refused: int = 0  # the trainer's buffer refused it (full)
    lost: int = 0  # the trainer died (or its reply never came) before it stored the trace
    dropped: int = 0  # not sent: MAX_IN_FLIGHT traces were outstanding

    def pending(self) -> int:
        return self.sent - self.acked - self.refused - self.lost


class RemoteTraceSink:
    def __init__(self, trainer):
        self.trainer = trainer
        self.counts = SinkCounts()
        self._pending: deque = deque()
        self._lock = threading.Lock()

    def put(self, trace: SequenceTrace) -> bool:
        self.reap()
        blob = trace_to_bytes(trace)
        with self._lock:
            if len(self._pending) >= MAX_IN_FLIGHT:
                self.counts.dropped += 1
                return False
            self._pending.append(self.trainer.put_trace.remote(blob))
            self.counts.sent += 1
        return True

    def reap(self, timeout: float = 0.0) -> None:
        """Collect the outcome of finished sends (all of them, waiting up to `timeout`). The engine's thread (put) and
        the metrics thread (stats) both reap: a finished send is taken out of `_pending` under the lock by exactly one
        of them, so each is counted once."""
        import ray

        with self._lock:
            refs = list(self._pending)
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        with self._lock:
            mine = [ref for ref in done if ref in self._pending]
            for ref in mine:
                self._pending.remove(ref)
        for ref in mine:
            try:
                stored = ray.get(ref)
            except Exception:  # noqa: BLE001 - RayActorError & co: the trainer is gone with the trace
                outcome = "lost"
            else:
                outcome = "acked" if stored else "refused"
            with self._lock:
                setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)

    def stats(self) -> BufferStats:  # the replica holds no traces: what it sent, and what never arrived
        c = self.counts
        return BufferStats(traces=0, bytes=0, capacity_bytes=0, added=c.acked, dropped=c.refused + c.lost + c.dropped, spilled=0, spill_dropped=0)

    def __len__(self) -> int:
        return 0

    def close(self, timeout: float = 5.0) -> None:
        self.reap(timeout)
        with self._lock:  # replies that never came within the timeout: counted as lost
            self.counts.lost += len(self._pending)
            self._pending.clear()


class PulledWeightStore(WeightStore):
    hashed_on_read = True  # version_from_bytes checks every fetched blob's checksum

    def __init__(self, trainer, poll_s: float = 0.2, keep: int = 4):
        super().__init__(keep)
        self.trainer, self.poll_s = trainer, poll_s
        self.trainer_status: dict | None = None
        self.trainer_unreachable = 0  # polls that failed (trainer dead or restarting)
        self.unreadable = 0  # fetched versions that failed to decode or checksum
        self.fetched = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-weights-poll", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def poll_once(self) -> None:
        import ray

        try:
            answer = ray.get(self.trainer.poll.remote(), timeout=RPC_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead, restarting or slow: keep serving what we have
            self.trainer_unreachable += 1
            if self.trainer_status is not None:
                self.trainer_status = dict(self.trainer_status, alive=False)
            return
        self.trainer_status = answer["status"]
        newest = self.latest()
        if answer["version"] is None or (newest is not None and answer["version"] <= newest.version):
            return
        try:
            version = version_from_bytes(ray.get(answer["ref"][0], timeout=RPC_TIMEOUT_S))
        except WeightRefused:
            self.unreadable += 1
            return
        except Exception:  # noqa: BLE001 - the object's owner (the trainer) died meanwhile
            self.trainer_unreachable += 1
            return
        with self._lock:
            self._versions.append(version)
            self._next = max(self._next, version.version + 1)  # an operator's adopt (admin API) publishes above it
        self.fetched += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(RPC_TIMEOUT_S + 1)


class TrainerView:
    """The Trainer protocol over the trainer actor (numbers as of the store's last poll)."""

    def __init__(self, trainer, store: PulledWeightStore):
        self.actor, self.store = trainer, store

    def _get(self, key, default=None):
        status = self.store.trainer_status
        return default if status is None else status.get(key, default)

    steps = property(lambda self: self._get("steps", 0))
    published = property(lambda self: self._get("published"))
    restores = property(lambda self: self._get("restores", 0))
    resumed_from_step = property(lambda self: self._get("resumed_from_step"))
    alive = property(lambda self: bool(self._get("alive", False)))
    losses = property(lambda self: [self._get("last")] if self._get("last") else [])
    error = property(lambda self: None if self._get("error") is None else RuntimeError(self._get("error")))

    def start(self, *args, **kwargs) -> "TrainerView":
        self.store.start()  # the actor trains from its own start; this replica starts listening
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.store.close()

    def request_restore(self, version: WeightVersion) -> int | None:
        import ray

        try:
            return ray.get(self.actor.request_restore.remote(version_to_bytes(version)), timeout=RPC_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the trainer is away: its next version is refused by the swapper's watch
            return None

    def save_checkpoint(self, path=None):
        import ray

        return ray.get(self.actor.save_checkpoint.remote(), timeout=120)


class RayFlywheel(Flywheel):
    """Flywheel whose trace buffer, weight store and trainer are the trainer actor, seen through proxies."""

    def __init__(self, engine, target, options: FlywheelOptions, trainer_actor, poll_s: float = 0.2):
        self._actor, self._poll_s = trainer_actor, poll_s
        super().__init__(engine, target, dataclasses.replace(options, trainer_process=False, checkpoint_dir=None, spill_dir=None))  # the actor keeps those

    def _train_in_process(self, target, drafter) -> None:
        self.buffer = RemoteTraceSink(self._actor)
        self.store = PulledWeightStore(self._actor, self._poll_s)
        self.trainer = TrainerView(self._actor, self.store) if self.options.train else None
        self.restored_traces = 0

    def metrics(self) -> dict:
        self.buffer.reap()
        return super().metrics() | {"traces_sent": self.buffer.counts.__dict__ | {"pending": self.buffer.counts.pending()},
                                    "trainer_unreachable": self.store.trainer_unreachable, "versions_fetched": self.store.fetched}

    def close(self) -> None:
        super().close()
        self.store.close()
