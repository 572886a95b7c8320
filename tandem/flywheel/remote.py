"""The flywheel's trainer in a child process, behind the interfaces the in-process pieces already offer.

In a thread the trainer competes with the engine thread for the interpreter lock and the cores (on 2 cores
serving measured 14-23 % slower with training on than off); a spawned child has its own interpreter, its own
torch threads and OMP_WAIT_POLICY=PASSIVE (idle OpenMP workers sleep instead of spinning on the engine's
core). The queues carry bytes and JSON strings only (no tensor or tandem object is pickled):

- traces, parent -> child: `trace_to_bytes` (safetensors + a JSON header) over a bounded queue; when it is
  full the trace is dropped and counted. The collector thread encodes; the engine thread never waits;
- weights, child -> parent: the child's WeightStore writes every version to a file (`save_version`, an atomic
  rename); the parent's `PolledWeightStore` lists the directory in `latest()`, so HotSwapper runs unchanged;
- control, parent -> child: JSON messages (start, stop, checkpoint; restore carries the good weights as
  safetensors bytes), each answered on the status queue;
- status, child -> parent: JSON snapshots (steps, published, restores, new loss records, error, buffer stats).

`TrainerProcess` is one proxy for both of the child's pieces: the collector's trace sink and the trainer,
with the names TraceBuffer and OnlineTrainer have (the `TraceSink` and `Trainer` protocols of
tandem.flywheel.loop, which a Ray actor would implement too, publishing through a WeightStore).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.child_env import child_environment
from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.buffer import BufferStats, TraceBuffer, refill
from tandem.flywheel.traces import SequenceTrace, trace_from_bytes, trace_to_bytes
from tandem.flywheel.trainer import FlywheelConfig, load_target_tables, resume_or_start, save_target_tables, wait_for
from tandem.flywheel.weights import PolledWeightStore, WeightStore, WeightVersion, checksum
from tandem.models.eagle import EagleHead, load_eagle, save_eagle

TRACE_QUEUE = 64  # traces in flight to the child; more are dropped (about 1 MB each for SmolLM2)
POLL_S = 0.02  # the child's longest wait for a trace before it looks at control messages
READY_TIMEOUT_S = 120.0  # spawn, imports, the head and the target's tables
REPLY_TIMEOUT_S = 120.0  # a control message's answer (a checkpoint writes the head and the optimiser moments)
JOIN_TIMEOUT_S = 30.0
TABLES_FILE, HEAD_DIR, VERSIONS_DIR = "target.safetensors", "head", "versions"


class TrainerProcessError(TandemError):
    """The trainer in the child process failed or the process ended; serving keeps the last adopted weights."""


@dataclass(frozen=True)
class ChildConfig:
    """What the child needs besides the target's tables and the head (sent as JSON)."""

    loss: FlywheelConfig
    buffer_bytes: int
    buffer_policy: str
    spill_dir: str | None  # the child's buffer spills here and is refilled from here
    checkpoint_dir: str | None  # resumed from when it holds anything
    threads: int  # the child's torch threads
    first_version: int  # the number of the first version the child publishes
    spill_max_bytes: int | None = None  # spill retention (TraceBuffer)
    spill_max_age_s: float | None = None
    cpus: tuple[int, ...] | None = None  # the child pins itself to these cores (a core of its own beside serving); None: the parent's

    def __post_init__(self) -> None:
        if self.cpus is not None:
            object.__setattr__(self, "cpus", tuple(self.cpus))  # JSON brings a list back
            if not self.cpus:
                raise InvalidParameterError("cpus must name at least one core (or be None)")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ChildConfig":
        values = json.loads(text)
        return cls(**values | {"loss": FlywheelConfig(**values["loss"])})


# ---- the parent's side --------------------------------------------------------------------------------------------
class _Reported:
    """A trainer field of TrainerProcess: the value the child reported last."""
    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, proxy, owner=None):
        return self if proxy is None else proxy._read(self.name)


class TrainerProcess:
    """The trainer and its TraceBuffer in a spawned child. This proxy is the flywheel's trace sink and its
    trainer; `store` is where the child's versions appear. The constructor returns once the child is ready
    (or raises what stopped it, e.g. a checkpoint directory without a readable checkpoint)."""

    def __init__(self, target, head: EagleHead, config: ChildConfig):
        self.config = config
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-trainer-"))
        self._remove_workdir = weakref.finalize(self, shutil.rmtree, str(self.workdir), True)
        self.store = PolledWeightStore(self.workdir / VERSIONS_DIR)
        self.losses: deque[dict] = deque(maxlen=200)
        self.restored_traces = 0  # traces the child refilled its buffer with from the spill directory
        self.channel_dropped = 0  # traces refused because the queue to the child was full
        self.process = None
        self._context = mp.get_context("spawn")
        self._traces, self._control, self._status = self._context.Queue(TRACE_QUEUE), self._context.Queue(), self._context.Queue()
        self._lock = threading.Lock()
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-trainer-control")
        self._state: dict = {}  # the child's last snapshot
        self._replies: dict[int, dict] = {}  # id of a control message a caller waits on -> the child's answer
        self._awaited: set[int] = set()
        self._sent = 0
        self._error: TrainerProcessError | None = None
        self._ready = self._finished = False  # the child sent "ready" / "closed" (it ended cleanly)
        self._closed = self._drained = False  # close() began / read the child's last words and closed the queues
        self._failure: str | None = None  # why the child could not start
        try:
            self._spawn(target, head)
        except BaseException:
            self.close()
            raise

    def _spawn(self, target, head: EagleHead) -> None:
        (self.workdir / VERSIONS_DIR).mkdir()
        save_target_tables(target, self.workdir / TABLES_FILE)
        save_eagle(head, self.workdir / HEAD_DIR)
        args = (str(self.workdir), self.config.to_json(), self._traces, self._control, self._status)
        with child_environment(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(self.config.threads)):
            self.process = self._context.Process(target=child_main, args=args, name="tandem-trainer", daemon=True)
            self.process.start()
        if not wait_for(lambda: self._refreshed(lambda: self._ready or self._failure is not None or not self.process.is_alive()), READY_TIMEOUT_S):
            raise TrainerProcessError(f"the trainer process was not ready within {READY_TIMEOUT_S:.0f} s")
        self._refresh()  # a child that failed and exited at once: its message may have followed the last look
        if not self._ready:
            raise TrainerProcessError(f"the trainer process could not start: {self._failure or f'exit code {self.process.exitcode}'}")
        (self.workdir / TABLES_FILE).unlink()  # the child has read them
        shutil.rmtree(self.workdir / HEAD_DIR)

    # ---- status -----------------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Take every message the child sent since the last look (any thread may look)."""
        with self._lock:
            if self._drained:
                return
            ended = self.process is not None and not self.process.is_alive()  # before draining: its last words are in the pipe
            while True:
                try:
                    self._receive(json.loads(self._status.get_nowait()))
                except queue.Empty:
                    break
            if ended and self._ready and self._error is None and not self._finished:
                self._error = TrainerProcessError(f"the trainer process ended (exit code {self.process.exitcode})")

    def _refreshed(self, predicate):
        self._refresh()
        return predicate()

    def _receive(self, message: dict) -> None:
        kind = message["kind"]
        if kind == "failed":
            self._failure = message["error"]
            return
        self._state = message["state"]
        self.losses.extend(message["losses"])
        if self._state["error"] is not None and self._error is None:
            self._error = TrainerProcessError(self._state["error"])
        if kind == "ready":
            self._ready, self.restored_traces = True, message["restored_traces"]
        elif kind == "reply" and message["id"] in self._awaited:
            self._replies[message["id"]] = message
        elif kind == "closed":
            self._finished = True

    def _read(self, key: str):
        self._refresh()
        return self._state[key]

    steps = _Reported()  # int
    published = _Reported()  # int | None
    restores = _Reported()  # int
    resumed_from_step = _Reported()  # int | None

    @property
    def error(self) -> TrainerProcessError | None:
        self._refresh()
        return self._error

    @property
    def alive(self) -> bool:
        """Training now: the process runs and its trainer thread too."""
        return self._read("training") and self.process.is_alive()

    # ---- the trace sink ----------------------------------------------------------------------------------------
    def put(self, trace: SequenceTrace) -> bool:
        """Send a trace to the child's buffer; False when the queue is full (dropped and counted, never waits)."""
        if not self._closed:
            with contextlib.suppress(queue.Full):
                self._traces.put_nowait(trace_to_bytes(trace))
                return True
        with self._lock:
            self.channel_dropped += 1
        return False

    def stats(self) -> BufferStats:
        """The child's buffer as last reported; `dropped` also counts the traces the queue refused."""
        reported = self._read("buffer")
        return BufferStats(**reported | {"dropped": reported["dropped"] + self.channel_dropped})

    def __len__(self) -> int:
        return self._read("buffer")["traces"]

    # ---- the trainer ---------------------------------------------------------------------------------------------
    def start(self, threads: int | None = 1, idle_s: float = 0.05, checkpoint_dir=None, checkpoint_every: int = 100, duty: float = 1.0) -> "TrainerProcess":
        """OnlineTrainer.start in the child (its trainer thread, checkpointing, duty share)."""
        if not 0 < duty <= 1:
            raise InvalidParameterError(f"duty must be in (0, 1], got {duty}")
        checkpoint = None if checkpoint_dir is None else str(checkpoint_dir)
        self._call("start", threads=threads, idle_s=idle_s, checkpoint_dir=checkpoint, checkpoint_every=checkpoint_every, duty=duty)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is not None and self.process.is_alive():
            self._call("stop", wait_s=timeout + 5.0, timeout=timeout)

    def request_restore(self, version: WeightVersion) -> int:
        """Serving rolled back to `version`: the child continues from those weights (sent, never waited for:
        the caller is the engine thread). Returns the `restores` count its versions trained from them carry."""
        from safetensors.torch import save

        self._send("restore", lambda: save({k: v.contiguous() for k, v in version.tensors.items()}), version=version.version)
        return self.restores + 1

    def save_checkpoint(self, path) -> Path:
        return Path(self._call("checkpoint", path=str(path))["result"])

    def _send(self, kind: str, payload=lambda: b"", awaited: bool = False, **args) -> int:
        """Queue a control message; the sender thread makes its payload, in order (a restore's weights: not here)."""
        with self._lock:
            self._sent += 1
            number = self._sent
            if awaited:
                self._awaited.add(number)
        header = json.dumps({"id": number, "kind": kind, "args": args})
        self._sender.submit(lambda: self._control.put((header, payload())))
        return number

    def _call(self, kind: str, wait_s: float = REPLY_TIMEOUT_S, **args) -> dict:
        """Send a control message and wait for the child's answer (never called from the engine thread)."""
        if self.process is None or not self.process.is_alive():
            raise TrainerProcessError(f"cannot {kind}: the trainer process is not running")
        number = self._send(kind, awaited=True, **args)
        if not wait_for(lambda: self._refreshed(lambda: number in self._replies or not self.process.is_alive()), wait_s):
            raise TrainerProcessError(f"the trainer process did not answer {kind!r} within {wait_s:.0f} s")
        with self._lock:
            self._awaited.discard(number)
            reply = self._replies.pop(number, None)
        if reply is None:
            raise TrainerProcessError(f"the trainer process ended during {kind!r} (exit code {self.process.exitcode})")
        if reply["error"] is not None:
            raise TrainerProcessError(f"{kind} failed in the trainer process: {reply['error']}")
        return reply

    # ---- the end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the child: it takes the traces sent before, flushes its spill and exits (terminated when it has
        not within JOIN_TIMEOUT_S); then the queues, the loader thread and the work directory go."""
        if self._closed:
            return
        self._closed = True
        self._sender.shutdown(wait=True)
        if self.process is not None:
            self._end_process()
        self._drained = True
        self.store.close()
        for channel in (self._traces, self._control, self._status):
            channel.cancel_join_thread()  # what a dead child never read must not hold the parent's exit
            channel.close()
        self._remove_workdir()

    def _end_process(self) -> None:
        with contextlib.suppress(queue.Full):
            if self.process.is_alive():
                self._traces.put(None, timeout=5.0)  # the end of the trace stream, behind the traces sent before
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while self.process.is_alive() and time.monotonic() < deadline:
            self._refresh()  # keep its status queue drained: a child blocked on a full pipe never exits
            self.process.join(0.05)
        for end in (self.process.terminate, self.process.kill):  # it did not end by itself in time
            if self.process.is_alive():
                end()
                self.process.join(5.0)
        self._refresh()


# ---- the child's side ---------------------------------------------------------------------------------------------
def child_main(workdir: str, config_json: str, traces, control, status) -> None:
    """The child's entry: build the buffer and the trainer, then serve the queues until the trace stream ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops the child (and checkpoints)
    config = ChildConfig.from_json(config_json)
    try:
        if config.cpus is not None:
            os.sched_setaffinity(0, config.cpus)  # before torch starts its threads: they inherit the mask
        torch.set_num_threads(config.threads)
        child = _Child(Path(workdir), config, status)
    except BaseException as e:  # the parent raises it from the flywheel's constructor
        status.put(json.dumps({"kind": "failed", "error": f"{type(e).__name__}: {e}"}))
        return
    child.run(traces, control)
    if not mp.parent_process().is_alive():  # killed without closing: nobody else removes the work directory
        shutil.rmtree(workdir, ignore_errors=True)


class _Child:
    def __init__(self, workdir: Path, config: ChildConfig, status):
        tables = load_target_tables(workdir / TABLES_FILE)
        self.buffer = TraceBuffer(config.buffer_bytes, config.buffer_policy, config.spill_dir, config.spill_max_bytes, config.spill_max_age_s)
        restored = refill(self.buffer, config.spill_dir)
        store = WeightStore(keep=1, directory=workdir / VERSIONS_DIR, first_version=config.first_version)
        self.trainer = resume_or_start(config.checkpoint_dir, tables, load_eagle(workdir / HEAD_DIR, tables), self.buffer, store, config.loss)
        self.status = status
        self.handlers = {"start": self._start, "stop": self._stop, "checkpoint": self._checkpoint, "restore": self._restore}
        self._reported: dict | None = None
        self._losses_sent = self.trainer.steps  # loss records of later steps go out with the next message
        self._send("ready", restored_traces=restored)

    def run(self, traces, control) -> None:
        parent = mp.parent_process()  # a parent killed without closing us: we end too, never an orphan
        try:
            while self._take_traces(traces) and parent.is_alive():
                self._take_control(control)
                if self._snapshot() != self._reported or self._new_losses():
                    self._send("status")
        finally:  # an exception ends the process without "closed": the parent reports it
            self.trainer.stop()
            self.buffer.close()
        self._send("closed")

    def _take_traces(self, traces) -> bool:
        """Move what arrived into the buffer (waiting POLL_S for the first); False at the end of the stream."""
        for i in range(TRACE_QUEUE):
            try:
                data = traces.get(timeout=POLL_S) if i == 0 else traces.get_nowait()
            except queue.Empty:
                return True
            if data is None:
                return False
            self.buffer.put(trace_from_bytes(data))
        return True

    def _take_control(self, control) -> None:
        while True:
            try:
                header, payload = control.get_nowait()
            except queue.Empty:
                return
            message = json.loads(header)
            try:
                self._send("reply", id=message["id"], result=self.handlers[message["kind"]](payload, **message["args"]), error=None)
            except Exception as e:  # answered: the parent raises it to its caller
                self._send("reply", id=message["id"], result=None, error=f"{type(e).__name__}: {e}")

    def _start(self, payload: bytes, **args) -> None:
        self.trainer.start(**args)

    def _stop(self, payload: bytes, timeout: float) -> None:
        self.trainer.stop(timeout)

    def _checkpoint(self, payload: bytes, path: str) -> str:
        return str(self.trainer.save_checkpoint(path))

    def _restore(self, payload: bytes, version: int) -> int:
        from safetensors.torch import load

        tensors = load(payload)
        return self.trainer.request_restore(WeightVersion(version, tensors, checksum(tensors)))

    def _snapshot(self) -> dict:
        t = self.trainer
        return {"steps": t.steps, "published": t.published, "restores": t.restores, "resumed_from_step": t.resumed_from_step,
                "training": t.alive, "error": repr(t.error) if t.error else None, "buffer": asdict(self.buffer.stats())}

    def _new_losses(self) -> list[dict]:
        # deque.copy() runs in C without releasing the interpreter lock: safe while the trainer thread appends
        return [r for r in self.trainer.losses.copy() if r["step"] > self._losses_sent]

    def _send(self, kind: str, **extra) -> None:
        losses = self._new_losses()
        if losses:
            self._losses_sent = losses[-1]["step"]
        self._reported = self._snapshot()
        self.status.put(json.dumps({"kind": kind, "state": self._reported, "losses": losses} | extra))
