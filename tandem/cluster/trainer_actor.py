"""The flywheel's trainer as a Ray actor: the trace buffer and the OnlineTrainer on their own resources.

Replicas `put_trace` (trace_to_bytes blobs) into the actor's TraceBuffer; the OnlineTrainer trains in the
actor's thread as in one process and publishes into `ObjectStoreWeights`, a WeightStore that also
`ray.put`s each version once (safetensors bytes); replicas poll `poll()` and fetch that one object.

The actor runs with `max_restarts`: when its process dies Ray re-runs `__init__` with the same spec, which
resumes from the last checkpoint (`resume_or_start`, published at once under a version number above every
one published before, so serving adopts it), and refills the buffer from the Parquet spill. Until then the
replicas keep serving the last version they adopted; traces they could not deliver are counted there.
"""
from __future__ import annotations

import json
import os
import threading
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch

from tandem.cluster.ray_env import pin_to_cores
from tandem.cluster.specs import TrainerSpec
from tandem.cluster.wire import version_from_bytes, version_to_bytes
from tandem.flywheel.buffer import TraceBuffer, refill
from tandem.flywheel.traces import trace_from_bytes
from tandem.flywheel.trainer import STATE_FILE, latest_checkpoint, resume_or_start
from tandem.flywheel.weights import WeightStore, WeightVersion


class TraceLedger:
    """Traces this trainer accepted and how many its spill has written, in a small JSON file rewritten on
    every accepted trace: a trainer starting after a crash adds its predecessor's accepted-but-unspilled
    traces to `lost_total` (an upper bound: a shard written after the last update counts as lost)."""

    def __init__(self, state_dir: str):
        self.path = Path(state_dir) / "trace_ledger.json"
        self.lost_total = self.accepted_count = 0
        self._lock = threading.Lock()  # the actor serves several put_trace calls at once (max_concurrency)
        if self.path.is_file():
            previous = json.loads(self.path.read_text())
            self.lost_total = int(previous["lost_total"]) + max(0, int(previous["accepted"]) - int(previous["spilled"]))
        self._write(0)

    def accepted(self, spilled: int) -> None:
        with self._lock:  # two writers of one temporary file: the second replace found it gone and its trace counted lost
            self.accepted_count += 1
            self._write(spilled)

    def _write(self, spilled: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"lost_total": self.lost_total, "accepted": self.accepted_count, "spilled": spilled}))
        os.replace(tmp, self.path)


class ObjectStoreWeights(WeightStore):
    """A WeightStore whose every published version is also in Ray's object store, once (`refs`)."""

    def __init__(self, keep: int = 4, first_version: int = 1):
        super().__init__(keep, first_version=first_version)
        self.first_version = first_version  # this actor's lifetime publishes from here up
        self.refs: deque[tuple[int, object]] = deque(maxlen=keep)

    def publish(self, tensors, meta=None) -> WeightVersion:
        import ray

        version = super().publish(tensors, meta)
        self.refs.append((version.version, ray.put(version_to_bytes(version))))
        return version

    def newest_ref(self):
        return self.refs[-1] if self.refs else None


def _first_version(spec: TrainerSpec, served_version: int) -> int:
    """Above every version published before a restart (the checkpoint records the last), else after the served one."""
    checkpoint = latest_checkpoint(spec.checkpoint_dir) if spec.checkpoint_dir else None
    if checkpoint is None:
        return served_version + 1
    published = json.loads((checkpoint / STATE_FILE).read_text()).get("published") or served_version
    return max(served_version, int(published)) + 1


def trace_buffer(spec: TrainerSpec) -> TraceBuffer:
    """The actor's buffer: spilled under spec.spill_dir with the spec's retention (the oldest shards pruned beyond it)."""
    return TraceBuffer(spec.buffer_bytes, spec.buffer_policy, spec.spill_dir, spill_max_bytes=spec.spill_max_bytes, spill_max_age_s=spec.spill_max_age_s)


class TrainerActor:
    """Wrapped by `trainer_actor(spec)`; every method is called through Ray (a threaded actor)."""

    def __init__(self, spec: TrainerSpec):
        from tandem.drafters import build_drafter
        from tandem.models.loader import load_transformer
        from tandem.models.zoo import resolve_model

        self.spec = spec
        self.cores = pin_to_cores(spec.placement.cores)
        torch.set_num_threads(spec.threads)
        target = load_transformer(resolve_model(spec.model))
        extra = {"draft_vocab_size": spec.draft_vocab_size} if spec.draft_vocab_size else {}
        drafter = build_drafter("eagle", target=target, num_draft_tokens=spec.num_draft_tokens, drafter_path=spec.drafter_path, max_batch=1,
                                max_len=64, **extra)
        self.buffer = trace_buffer(spec)
        self.restored_traces = refill(self.buffer, spec.spill_dir)
        self.ledger = TraceLedger(spec.state_dir)  # traces a dead predecessor held but never spilled: counted lost
        self.store = ObjectStoreWeights(first_version=_first_version(spec, drafter.version))
        self.trainer = resume_or_start(spec.checkpoint_dir, target, drafter.head, self.buffer, self.store, spec.loss)
        self.refused_traces = 0  # blobs that could not be decoded
        self.trainer.start(spec.threads, checkpoint_dir=spec.checkpoint_dir, checkpoint_every=spec.checkpoint_every)

    # ---- the trace sink (replicas) -------------------------------------------------------------------------
    def put_trace(self, blob: bytes) -> bool:
        try:
            trace = trace_from_bytes(blob)
        except Exception:  # noqa: BLE001 - a corrupt blob is refused and counted, never trained on
            self.refused_traces += 1
            return False
        stored = self.buffer.put(trace)
        if stored:
            self.ledger.accepted(self.buffer.stats().spilled)
        return stored

    # ---- the weights (replicas poll) -------------------------------------------------------------------------
    def poll(self) -> dict:
        """The newest version's number and its object ref (in a list, so Ray hands the ref, not the bytes),
        and the trainer's status."""
        newest = self.store.newest_ref()
        return {"version": None if newest is None else newest[0], "ref": None if newest is None else [newest[1]], "status": self.status()}

    def status(self) -> dict:
        t = self.trainer
        return {"steps": t.steps, "published": t.published, "restores": t.restores, "resumed_from_step": t.resumed_from_step,
                "alive": t.alive, "error": repr(t.error) if t.error else None, "last": t.losses[-1] if t.losses else None,
                "buffer": asdict(self.buffer.stats()), "restored_traces": self.restored_traces, "refused_traces": self.refused_traces,
                "lost_with_buffer": self.ledger.lost_total,
                "first_version": self.store.first_version,
                "pid": os.getpid(), "cores": list(self.cores)}

    # ---- control -----------------------------------------------------------------------------------------------
    def request_restore(self, blob: bytes) -> int:
        return self.trainer.request_restore(version_from_bytes(blob))

    def save_checkpoint(self) -> str | None:
        if self.spec.checkpoint_dir is None:
            return None
        return str(self.trainer.save_checkpoint(Path(self.spec.checkpoint_dir)))

    def stop(self) -> None:
        self.trainer.stop()
        if self.spec.checkpoint_dir is not None and self.trainer.error is None:
            self.trainer.save_checkpoint(Path(self.spec.checkpoint_dir))
        self.buffer.close()


def trainer_actor(spec: TrainerSpec, name: str | None = None):
    """Start the trainer actor (restarted by Ray up to spec.placement.max_restarts times)."""
    import ray

    from tandem.errors import InvalidParameterError

    if spec.state_dir is None:
        raise InvalidParameterError("the trainer actor needs TrainerSpec.state_dir (checkpoints, spilled traces, the trace ledger): a restart resumes from it")
    options = spec.placement.options(max_concurrency=8, **({"name": name} if name else {}))
    return ray.remote(TrainerActor).options(**options).remote(spec)
