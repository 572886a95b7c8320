"""The trace buffer: in process, bounded by bytes, never blocks the producer; optional Parquet spill.

`put` never waits (a short lock): when the buffer is over its byte budget it drops by policy
(`drop_oldest`: evict old traces, the default, since fresh traffic is what the drafter should follow;
`balance_domains`: evict the oldest trace of the domain holding the most bytes, so a long run of one
domain does not erase the others (the flywheel's default); `drop_newest`: refuse the new one) and
counts the drops (`stats()`). With `spill_dir`, every accepted
trace is also appended to Parquet shards (one row per trace, tensors as raw bytes + dtype + shape) by a
background writer, so traces survive a restart (`load_traces`) and can train a drafter offline
(`tandem train --data DIR`). Spilled shards are pruned after each write (and at start), oldest first,
down to `spill_max_bytes` and to those younger than `spill_max_age_s` (None: no bound of that kind), so a
long-running server keeps a bounded window of its users' traffic on disk. The interface (put / sample / stats / close) is what a Ray-backed buffer
would implement too.
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.traces import SequenceTrace, trace_from_parts, trace_header

POLICIES = ("drop_oldest", "balance_domains", "drop_newest")
SHARD_ROWS = 64  # traces per Parquet shard


@dataclass
class BufferStats:
    traces: int  # held now
    bytes: int  # held now
    capacity_bytes: int
    added: int  # accepted since start
    dropped: int  # evicted or refused because the buffer was full
    spilled: int  # written to Parquet
    spill_dropped: int  # could not be queued for spilling (writer behind)
    spill_pruned: int = 0  # shards deleted by the spill's retention (bytes, age)


class TraceBuffer:
    def __init__(self, capacity_bytes: int = 512 << 20, policy: str = "drop_oldest", spill_dir: str | Path | None = None,
                 spill_max_bytes: int | None = None, spill_max_age_s: float | None = None):
        if capacity_bytes < 1:
            raise InvalidParameterError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if policy not in POLICIES:
            raise InvalidParameterError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._items: deque[SequenceTrace] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._added = self._dropped = 0
        self._spill = None if spill_dir is None else _ParquetSpill(Path(spill_dir), max_bytes=spill_max_bytes, max_age_s=spill_max_age_s)

    def put(self, trace: SequenceTrace, spill: bool = True) -> bool:
        """Add a trace; returns False if it was dropped (never blocks). spill=False: don't write it to the
        Parquet shards (it came from them)."""
        size = trace.num_bytes
        with self._lock:
            if size > self.capacity_bytes or (self.policy == "drop_newest" and self._bytes + size > self.capacity_bytes):
                self._dropped += 1
                return False
            while self._bytes + size > self.capacity_bytes:
                self._bytes -= self._evict(trace.domain).num_bytes
                self._dropped += 1
            self._items.append(trace)
            self._bytes += size
            self._added += 1
        if spill and self._spill is not None:
            self._spill.put(trace)
        return True

    def _evict(self, incoming: str) -> SequenceTrace:
        """Remove and return one trace by policy (under the lock)."""
        if self.policy != "balance_domains":
            return self._items.popleft()
        held: dict[str, int] = {incoming: 0}
        for t in self._items:
            held[t.domain] = held.get(t.domain, 0) + t.num_bytes
        held[incoming] += 1  # ties: the incoming trace's domain gives way first
        largest = max(held, key=held.get)
        index = next((i for i, t in enumerate(self._items) if t.domain == largest), 0)
        trace = self._items[index]
        del self._items[index]
        return trace

    def sample(self, n: int, rng: random.Random, recent: int | None = None, by_domain: bool = False) -> list[SequenceTrace]:
        """n traces drawn with replacement (from the `recent` newest only, if given); [] if empty. Uniformly
        over traces, or with `by_domain` a domain uniformly and then one of its traces, so a domain served
        long ago (few traces left, or few against a long new block) is replayed as often as the current one."""
        with self._lock:
            items = list(self._items)[-recent:] if recent else list(self._items)
        if not items:
            return []
        if not by_domain:
            return [rng.choice(items) for _ in range(n)]
        groups: dict[str, list[SequenceTrace]] = {}
        for t in items:
            groups.setdefault(t.domain, []).append(t)
        names = sorted(groups)
        return [rng.choice(groups[rng.choice(names)]) for _ in range(n)]

    def snapshot(self) -> list[SequenceTrace]:
        """The traces held now, oldest first."""
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> BufferStats:
        spilled, spill_dropped, pruned = (self._spill.written, self._spill.dropped, self._spill.pruned) if self._spill else (0, 0, 0)
        with self._lock:
            return BufferStats(len(self._items), self._bytes, self.capacity_bytes, self._added, self._dropped, spilled, spill_dropped, pruned)

    def close(self) -> None:
        """Flush pending spills to disk."""
        if self._spill is not None:
            self._spill.close()


# ---- Parquet ------------------------------------------------------------------------------------------------
def _trace_row(trace: SequenceTrace) -> dict:
    row = trace_header(trace)
    for name, tensor in trace.tensors().items():
        t = tensor.contiguous()
        row[f"{name}.data"] = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        row[f"{name}.dtype"] = str(t.dtype).removeprefix("torch.")
        row[f"{name}.shape"] = list(t.shape)
    return row


def _row_trace(row: dict) -> SequenceTrace:
    tensors = {}
    for f in fields(SequenceTrace):
        if f"{f.name}.data" in row:
            dtype, shape = getattr(torch, row[f"{f.name}.dtype"]), tuple(row[f"{f.name}.shape"])
            data = row[f"{f.name}.data"]
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            tensors[f.name] = flat.view(dtype).reshape(shape).clone()
    return trace_from_parts(row, tensors)


def write_shard(path: Path, traces: list[SequenceTrace]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")  # two writers of one name never share a temporary
    pq.write_table(pa.Table.from_pylist([_trace_row(t) for t in traces]), tmp)
    os.replace(tmp, path)  # readers never see half a shard


def load_traces(directory: str | Path, limit: int | None = None, newest: bool = False) -> list[SequenceTrace]:
    """The traces in the Parquet shards of `directory`, oldest shard first (newest=True: the newest `limit`
    traces, still oldest first). Unreadable shards raise."""
    import pyarrow.parquet as pq

    directory = Path(directory)
    shards = sorted(directory.glob("traces-*.parquet"))
    if newest:
        shards = shards[::-1]
    if not shards:
        raise TandemError(f"no trace shards (traces-*.parquet) in {directory}")
    out: list[SequenceTrace] = []
    for shard in shards:
        try:
            rows = pq.read_table(shard).to_pylist()
        except Exception as e:
            raise TandemError(f"cannot read trace shard {shard}: {e}") from e
        out.extend(_row_trace(r) for r in (rows[::-1] if newest else rows))
        if limit is not None and len(out) >= limit:
            out = out[:limit]
            break
    return out[::-1] if newest else out


def refill(buffer: TraceBuffer, spill_dir: str | Path | None, limit: int = 4096) -> int:
    """Put the newest `limit` traces an earlier run spilled to `spill_dir` back into `buffer` (they are not
    spilled again); returns how many."""
    if spill_dir is None or not any(Path(spill_dir).glob("traces-*.parquet")):
        return 0
    traces = load_traces(spill_dir, limit=limit, newest=True)
    for trace in traces:
        buffer.put(trace, spill=False)
    return len(traces)


def prune_shards(directory: Path, max_bytes: int | None, max_age_s: float | None, now: float | None = None) -> int:
    """Delete trace shards older than max_age_s, then the oldest ones until the rest fit max_bytes; returns
    how many were deleted. Shard names carry their write time (time_ns), which orders them."""
    now = time.time() if now is None else now
    shards = []
    for path in sorted(directory.glob("traces-*.parquet")):
        try:
            shards.append((path, path.stat().st_size, int(path.stem.removeprefix("traces-")) / 1e9))
        except (OSError, ValueError):
            continue  # removed meanwhile, or not one of ours
    total, deleted = sum(size for _, size, _ in shards), 0
    for path, size, written in shards:  # oldest first
        too_old = max_age_s is not None and now - written > max_age_s
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            break
        path.unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


class _ParquetSpill:
    """Background writer: traces are queued (never blocking the buffer) and written SHARD_ROWS at a time."""

    def __init__(self, directory: Path, max_queue: int = 1024, max_bytes: int | None = None, max_age_s: float | None = None):
        if (max_bytes is not None and max_bytes < 0) or (max_age_s is not None and max_age_s <= 0):
            raise InvalidParameterError(f"spill retention must be >= 0 bytes and > 0 s, got {max_bytes} bytes, {max_age_s} s")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.pruned = prune_shards(directory, max_bytes, max_age_s)  # shards deleted by retention
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.written = self.dropped = 0
        self.error: BaseException | None = None
        self._pending: list[SequenceTrace] = []
        self._thread = threading.Thread(target=self._loop, name="tandem-trace-spill", daemon=True)
        self._thread.start()

    def put(self, trace: SequenceTrace) -> None:
        try:
            self.queue.put_nowait(trace)
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is not None:
                self._pending.append(item)
            if item is None or len(self._pending) >= SHARD_ROWS:
                self._write()
            if item is None:
                return

    def _write(self) -> None:
        if not self._pending:
            return
        name = f"traces-{time.time_ns():020d}.parquet"
        try:
            write_shard(self.directory / name, self._pending)
            self.written += len(self._pending)
            self.pruned += prune_shards(self.directory, self.max_bytes, self.max_age_s)
        except Exception as e:  # a full disk loses spills, never serving
            self.error = e
            self.dropped += len(self._pending)
        self._pending = []

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=60)
