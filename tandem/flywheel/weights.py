"""Versioned drafter weights and the engine-side hot-swap with acceptance-collapse rollback.

The trainer `publish`es its head's `trainable_state` to a `WeightStore` (CPU copies, a version number, a
checksum). A version carries only what training can change (tandem.models.head_state): a head's shared LM head
(the target's rows, frozen) is never published, saved, checksummed, validated nor written at install. The
engine-side `HotSwapper` is both an engine `between_steps` hook and an observer:

- between steps it adopts the newest version: a background thread first validates it (exactly the served
  head's trainable names, shapes and dtypes as served, every value finite, the checksum recomputed), then
  the next between-steps call copies it into the serving head in place (`tensor.copy_`, no new parameters,
  nothing recompiled) and rebuilds the prepacked CPU copies of the Linears it wrote. A step therefore never
  mixes versions and serving pauses for the copy only. Refused versions are counted and never retried.
- as an observer it tracks acceptance length per drafter version over the last `window` request-steps.
  When a swapped-in version's mean falls below `collapse_ratio` x the baseline (the previous version's
  recent mean, or, when that version served fewer than window / 2 request-steps, the mean of the last
  `window` request-steps served by any version), it rolls back to the last good weights (same in-place
  copy), raises the alarm counter and calls `on_rollback(good_version)` so the trainer continues from
  them; versions published before the trainer applied that restore (meta "restores" lower than the
  number `on_rollback` returned) descend from the collapsed weights and are never adopted.

Requests in flight keep the draft-cache entries their old head wrote (recomputing them would stall
serving by a prefill); verification keeps the output lossless either way.

A trainer in another process publishes through files (`save_version`: safetensors, its meta included,
renamed into place); the serving side's `PolledWeightStore` finds them in `latest()`. Files written before
versions left the shared LM head out still load: `load_version(path, frozen=derived_keys(cfg))` drops it.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tandem.errors import TandemError
from tandem.models.head_state import install_trainable, trainable_state
from tandem.ops.checks import all_finite
from tandem.types import StepRecord


class WeightRefused(TandemError):
    """A published version failed validation (non-finite values, wrong shapes, checksum mismatch)."""


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().data)
    return digest.hexdigest()


@dataclass(frozen=True)
class WeightVersion:
    version: int
    tensors: dict[str, torch.Tensor]  # CPU copies
    checksum: str
    meta: dict = field(default_factory=dict)


class WeightStore:
    """The trainer -> engine channel: the newest `keep` versions in memory, optionally also on disk."""

    hashed_on_read = False  # its versions were checksummed against the bytes they were read from (validate need not hash again)

    def __init__(self, keep: int = 4, directory: str | Path | None = None, first_version: int = 1):
        self.keep = keep
        self.directory = None if directory is None else Path(directory)
        self._versions: deque[WeightVersion] = deque(maxlen=keep)
        self._next = first_version
        self._lock = threading.Lock()

    def publish(self, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> WeightVersion:
        copies = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        with self._lock:
            version = WeightVersion(self._next, copies, checksum(copies), dict(meta or {}, published_at=time.time()))
            self._next += 1
            self._versions.append(version)
        if self.directory is not None:
            save_version(version, self.directory)
        return version

    def latest(self) -> WeightVersion | None:
        with self._lock:
            return self._versions[-1] if self._versions else None


VERSION_FILE = re.compile(r"drafter-v(\d+)\.safetensors")  # save_version's names (".tmp": still being written)


def save_version(version: WeightVersion, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"drafter-v{version.version:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    metadata = {"version": str(version.version), "checksum": version.checksum, "meta": json.dumps(version.meta)}
    save_file({k: v.contiguous() for k, v in version.tensors.items()}, str(tmp), metadata=metadata)
    tmp.rename(path)
    return path


def load_version(path: str | Path, frozen: tuple[str, ...] = ()) -> WeightVersion:
    """Read a published version from disk (safetensors only), its meta included (a trainer in another process
    publishes through these files, and the swapper reads meta["restores"]); a corrupt file or checksum
    mismatch raises WeightRefused. `frozen` (the head's `derived_keys`): entries dropped once the file's checksum
    passed, the checksum recomputed without them: files written before versions left out a shared LM head
    carry it, and a version that carries it is refused."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        extra = json.loads(meta.get("meta", "{}"))  # files written before meta was kept have none
    except Exception as e:
        raise WeightRefused(f"cannot read drafter weights {path}: {e}") from e
    if "version" not in meta or "checksum" not in meta:
        raise WeightRefused(f"{path} lacks version/checksum metadata")
    version = WeightVersion(int(meta["version"]), tensors, meta["checksum"], extra)
    if checksum(tensors) != version.checksum:
        raise WeightRefused(f"{path}: checksum mismatch (corrupt or tampered file)")
    if any(name in tensors for name in frozen):
        kept = {k: v for k, v in tensors.items() if k not in frozen}
        version = WeightVersion(version.version, kept, checksum(kept), extra)
    return version


class PolledWeightStore(WeightStore):
    """A WeightStore another process publishes into `watched`. `latest()` lists the directory (microseconds)
    and hands the newest file not seen yet to a loader thread: reading and checksumming a head takes
    milliseconds the engine thread must not spend. Each file is read at most once; once a version is loaded
    the older files are deleted (the swapper keeps the versions it serves or may roll back to). With
    `directory` set (the admin API's version history) every loaded version is also written there, as
    WeightStore.publish does."""

    hashed_on_read = True  # load_version checks every file's checksum: the swapper's validation does not hash the same tensors again

    def __init__(self, watched: Path, keep: int = 4):
        super().__init__(keep)
        self.watched = watched
        self.unreadable = 0  # files that could not be loaded (or copied to `directory`): never adopted
        self._seen = -1  # the newest version number handed to the loader
        self._poll_lock = threading.Lock()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-weights-load")
        self._loading: concurrent.futures.Future | None = None

    def latest(self) -> WeightVersion | None:
        with self._poll_lock:
            self._collect()
            files = version_files(self.watched)
            if files and files[-1][0] > self._seen and self._loading is None:
                self._seen, path = files[-1]
                self._loading = self._loader.submit(self._load, path)
        return super().latest()

    def _load(self, path: Path) -> WeightVersion:
        version = load_version(path)
        if self.directory is not None:
            save_version(version, self.directory)
        return version

    def _collect(self) -> None:
        if self._loading is None or not self._loading.done():
            return
        future, self._loading = self._loading, None
        try:
            version = future.result()
        except (WeightRefused, OSError):  # never adopted; the engine thread must not see it
            self.unreadable += 1
            return
        with self._lock:
            self._versions.append(version)
            self._next = max(self._next, version.version + 1)
        for number, path in version_files(self.watched):
            if number < version.version:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self._loader.shutdown(wait=True)


def version_files(directory: Path) -> list[tuple[int, Path]]:
    """(version, path) of the complete version files in `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), directory / name) for name in names if (m := VERSION_FILE.fullmatch(name)))


def validate(version: WeightVersion, served: dict[str, torch.Tensor], rehash: bool = True) -> None:
    """Raise WeightRefused unless `version` can replace `served` (the head's `trainable_state`) in place. rehash=False:
    the checksum was verified against the bytes the tensors were just read from (`load_version`), so hashing them
    again (~35 ms for SmolLM2's head, on the serving core) checks nothing new."""
    missing, extra = sorted(set(served) - set(version.tensors)), sorted(set(version.tensors) - set(served))
    if missing or extra:
        raise WeightRefused(f"version {version.version}: its tensors are not the served head's trainable ones: missing {missing}, "
                            f"not taken {extra} (a shared LM head is frozen: versions never carry it)")
    for name, tensor in version.tensors.items():
        ref = served[name]
        if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
            raise WeightRefused(f"version {version.version}: {name} is {tuple(tensor.shape)} {tensor.dtype}, served {tuple(ref.shape)} {ref.dtype}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise WeightRefused(f"version {version.version}: {name} has NaN/Inf values")
        if not tensor.is_floating_point() and not torch.equal(tensor, ref.cpu()):
            raise WeightRefused(f"version {version.version}: {name} (index data) differs from the served head")
    if rehash and checksum(version.tensors) != version.checksum:
        raise WeightRefused(f"version {version.version}: checksum mismatch")


MAX_EVENTS = 256  # swap / refusal / rollback events kept (the newest): a server runs for months
UNJUDGED_AFTER = 4  # x window: request-steps without a draft after which a swapped-in version's watch ends unjudged


def _keep_last(items: list, n: int = MAX_EVENTS) -> None:
    if len(items) > n:
        del items[: len(items) - n]


@dataclass
class SwapStats:
    version: int = 0  # serving now
    swaps: int = 0
    refused: int = 0
    rollbacks: int = 0
    alarms: int = 0  # collapse alarms raised (each one rolled back)
    unjudged: int = 0  # watches ended without a verdict: too few drafted steps (the controller was not drafting)
    swap_ms: list[float] = field(default_factory=list)  # time of each in-place copy (incl. rollbacks), the newest MAX_EVENTS
    events: list[dict] = field(default_factory=list)  # [{"time", "kind": swap|refused|rollback, "version", ...}], the newest MAX_EVENTS
    max_swap_ms: float = 0.0  # of all swaps since start

    def as_dict(self) -> dict:
        return {"version": self.version, "swaps": self.swaps, "refused": self.refused, "rollbacks": self.rollbacks,
                "alarms": self.alarms, "unjudged": self.unjudged, "max_swap_ms": round(self.max_swap_ms, 2)}


class HotSwapper:
    def __init__(self, drafter, store: WeightStore, collapse_ratio: float = 0.5, window: int = 64, background: bool = True):
        self.drafter = drafter
        self.head = drafter.head
        self.store = store
        self.collapse_ratio = collapse_ratio
        self.window = window
        self.stats = SwapStats(version=drafter.version)
        self._serving = WeightVersion(drafter.version, self._served_copy(), "")  # what the head holds now
        self._good = self._serving  # last version that passed its acceptance watch (initially the served one)
        self._recent: dict[int, deque[int]] = {}  # version -> emitted tokens per request-step (recent window)
        self._baseline: float | None = None  # previous version's recent mean at the last swap
        self._watching: int | None = None  # version under watch after a swap
        self._plain_steps = 0  # request-steps without a draft since the watched version went in
        self._rollback = False
        self._bad: set[int] = set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-weights") if background else None
        self._pending: tuple[WeightVersion, concurrent.futures.Future] | None = None
        self._served: deque[int] = deque(maxlen=window)  # emitted tokens of the last request-steps, any version
        self.on_rollback: Callable[[WeightVersion], int | None] | None = None  # the trainer's request_restore
        self._min_restores = 0  # adopt only versions whose meta["restores"] reached this

    def _served_copy(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.head).items()}

    # ---- between steps --------------------------------------------------------------------------------
    def __call__(self, engine=None) -> None:
        if self._rollback:
            self._install(self._good, "rollback")
            self._rollback = False
            if self.on_rollback is not None:
                required = self.on_rollback(self._good)
                self._min_restores = required if required is not None else self._min_restores
            return
        if self._watching is not None:
            return  # one swap at a time: the new version must pass its watch window first
        if self._pending is not None:
            version, future = self._pending
            if not future.done():
                return
            self._pending = None
            error = future.exception()
            if error is None:
                self._adopt(version)
            else:
                self._refuse(version, error)
            return
        candidate = self.store.latest()
        if candidate is None or candidate.version <= self.stats.version or candidate.version in self._bad:
            return
        if candidate.meta.get("restores", 0) < self._min_restores:
            return  # trained on from the collapsed weights: wait for the trainer's restore
        rehash = not self.store.hashed_on_read
        if self._executor is None:
            try:
                validate(candidate, trainable_state(self.head), rehash)
            except WeightRefused as e:
                self._refuse(candidate, e)
                return
            self._adopt(candidate)
        else:
            self._pending = (candidate, self._executor.submit(validate, candidate, trainable_state(self.head), rehash))

    def _adopt(self, version: WeightVersion) -> None:
        self._baseline = self._mean(self.stats.version)
        if self._baseline is None and self._served:  # the serving version is young: compare with recent serving
            self._baseline = sum(self._served) / len(self._served)
        previous = self.stats.version
        self._install(version, "swap")
        self._watching, self._plain_steps = version.version, 0
        self.stats.events[-1]["from"] = previous

    def _refuse(self, version: WeightVersion, error: BaseException) -> None:
        self._bad.add(version.version)
        self.stats.refused += 1
        self.stats.events.append({"time": time.time(), "kind": "refused", "version": version.version, "reason": str(error)})
        _keep_last(self.stats.events)

    def _install(self, version: WeightVersion, kind: str) -> None:
        start = time.perf_counter()
        install_trainable(self.head, version.tensors)
        previous = self.drafter.version
        self.drafter.version = version.version
        self._serving = version
        self.stats.swap_ms.append(1000 * (time.perf_counter() - start))
        self.stats.max_swap_ms = max(self.stats.max_swap_ms, self.stats.swap_ms[-1])
        for old in [v for v in self._recent if v not in (previous, version.version)]:  # windows of versions no longer compared
            del self._recent[old]
        self._bad = {v for v in self._bad if v > min(previous, version.version)}  # only newer versions are ever candidates
        self.stats.version = version.version
        if kind == "swap":
            self.stats.swaps += 1
        else:
            self.stats.rollbacks += 1
        self.stats.events.append({"time": time.time(), "kind": kind, "version": version.version, "ms": round(self.stats.swap_ms[-1], 2)})
        _keep_last(self.stats.events)
        _keep_last(self.stats.swap_ms)

    # ---- acceptance watch -----------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        """Engine observer: count emitted tokens per drafted request-step by drafter version."""
        if record.kind != "decode":
            return
        lengths = [len(e.emitted_tokens) for e in record.requests if e.draft_tokens]
        self._plain_steps += len(record.requests) - len(lengths)
        if self._watching is not None and self._plain_steps >= UNJUDGED_AFTER * self.window:
            self._watching = None  # drafting stopped (the speculation controller): unjudged, not promoted to good, no longer blocking
            self.stats.unjudged += 1
        self.observe_lengths(record.drafter_version, lengths)

    def observe_lengths(self, version: int, lengths: list[int]) -> None:
        recent = self._recent.setdefault(version, deque(maxlen=self.window))
        recent.extend(lengths)
        self._served.extend(lengths)
        if self._watching != version or len(recent) < self.window:
            return
        self._watching = None
        if self._baseline is not None and sum(recent) / len(recent) < self.collapse_ratio * self._baseline:
            self._bad.add(version)
            self.stats.alarms += 1
            self._rollback = True
        else:
            self._good = self._serving

    def _mean(self, version: int) -> float | None:
        recent = self._recent.get(version)
        if not recent or len(recent) < self.window // 2:
            return None
        return sum(recent) / len(recent)

    def attach(self, engine) -> "HotSwapper":
        engine.between_steps.append(self)
        engine.observers.append(self.observe)
        return self

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
