"""The trace buffer: bounded by bytes, drops counted, never blocks; Parquet spill round trip."""
import random
import time

import pytest
import torch

from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.buffer import TraceBuffer, load_traces

from flywheel_helpers import served_traces


@pytest.fixture(scope="module")
def traces(target):
    return served_traces(target, n=4)


def test_bounded_by_bytes_drop_oldest(traces):
    size = max(t.num_bytes for t in traces)
    buffer = TraceBuffer(capacity_bytes=2 * size + 1)
    for trace in traces:
        assert buffer.put(trace)
    stats = buffer.stats()
    assert stats.bytes <= 2 * size + 1 and stats.traces == 2 and stats.dropped == 2 and stats.added == 4
    kept = {t.request_id for t in buffer.sample(50, random.Random(0))}
    assert kept <= {traces[-1].request_id, traces[-2].request_id}  # the newest survive


def test_snapshot_is_every_held_trace_oldest_first(traces):
    size = max(t.num_bytes for t in traces)
    buffer = TraceBuffer(capacity_bytes=3 * size)
    for trace in traces:
        buffer.put(trace)
    held = buffer.snapshot()
    assert [t.request_id for t in held] == [t.request_id for t in traces[-len(held):]] and len(held) == len(buffer) >= 2
    held.clear()
    assert len(buffer.snapshot()) == len(buffer)  # a copy: the buffer keeps its traces


def test_balance_domains_keeps_every_domain(traces):
    """A long run of one domain evicts its own oldest traces, not the other domain's."""
    import dataclasses

    size = max(t.num_bytes for t in traces)
    buffer = TraceBuffer(capacity_bytes=4 * size, policy="balance_domains")
    buffer.put(dataclasses.replace(traces[0], request_id="sql-0", domain="sql"))
    for i in range(10):
        buffer.put(dataclasses.replace(traces[i % len(traces)], request_id=f"code-{i}", domain="code"))
    ids = [t.request_id for t in buffer._items]
    assert "sql-0" in ids and ids[1:] == [f"code-{i}" for i in range(10 - len(ids) + 1, 10)]
    assert buffer.stats().dropped == 11 - len(ids)


def test_drop_newest_refuses_and_counts(traces):
    buffer = TraceBuffer(capacity_bytes=traces[0].num_bytes, policy="drop_newest")
    assert buffer.put(traces[0])
    assert not buffer.put(traces[1])
    assert buffer.stats().dropped == 1 and len(buffer) == 1


def test_full_buffer_never_blocks(traces):
    buffer = TraceBuffer(capacity_bytes=traces[1].num_bytes)
    start = time.perf_counter()
    for _ in range(2000):
        buffer.put(traces[1])
    assert time.perf_counter() - start < 2.0
    assert buffer.stats().dropped == 1999


def test_bad_settings_are_refused():
    with pytest.raises(InvalidParameterError):
        TraceBuffer(capacity_bytes=0)
    with pytest.raises(InvalidParameterError):
        TraceBuffer(policy="lifo")


def test_parquet_spill_round_trip(traces, tmp_path):
    buffer = TraceBuffer(spill_dir=tmp_path)
    for trace in traces:
        buffer.put(trace)
    buffer.close()
    assert buffer.stats().spilled == len(traces)
    loaded = load_traces(tmp_path)
    assert [t.request_id for t in loaded] == [t.request_id for t in traces]
    for a, b in zip(loaded, traces):
        assert a.domain == b.domain and a.prompt_len == b.prompt_len and a.taps == b.taps
        for name, tensor in b.tensors().items():
            assert torch.equal(a.tensors()[name], tensor), name
    assert [t.request_id for t in load_traces(tmp_path, limit=2, newest=True)] == [t.request_id for t in traces[-2:]]


def test_corrupt_shard_is_a_clear_error(tmp_path):
    (tmp_path / "traces-0001.parquet").write_bytes(b"not parquet")
    with pytest.raises(TandemError, match="cannot read trace shard"):
        load_traces(tmp_path)
    with pytest.raises(TandemError, match="no trace shards"):
        load_traces(tmp_path / "empty")


def test_spill_retention_by_age_and_bytes(traces, tmp_path):
    from tandem.flywheel.buffer import write_shard

    now = time.time_ns()
    day = 86_400 * 10**9
    names = [f"traces-{t:020d}.parquet" for t in (now - 9 * day, now - 3 * day, now - 2 * day, now - 1 * day)]
    for name, trace in zip(names, traces):
        write_shard(tmp_path / name, [trace])
    shard = (tmp_path / names[-1]).stat().st_size
    buffer = TraceBuffer(spill_dir=tmp_path, spill_max_age_s=7 * 86_400, spill_max_bytes=int(2.5 * shard))
    assert sorted(p.name for p in tmp_path.glob("traces-*.parquet")) == names[2:]  # 9 days old: too old; then the oldest over 2.5 shards
    buffer.put(traces[0])
    buffer.close()  # writes one more shard, then prunes to the byte bound again
    left = sorted(p.name for p in tmp_path.glob("traces-*.parquet"))
    assert len(left) == 2 and left[0] == names[3] and left[1] > names[3]
    assert buffer._spill.pruned == 3
    assert sum(p.stat().st_size for p in tmp_path.glob("*.parquet")) <= 2.5 * shard


def test_spill_retention_settings_are_checked(tmp_path):
    with pytest.raises(InvalidParameterError, match="retention"):
        TraceBuffer(spill_dir=tmp_path, spill_max_age_s=0)


def test_balanced_sampling_draws_each_domain_equally(traces):
    """by_domain: a domain uniformly, then one of its traces: 10 sql traces among 100 get half the draws."""
    import dataclasses

    buffer = TraceBuffer(capacity_bytes=1 << 30)
    for i in range(100):
        buffer.put(dataclasses.replace(traces[i % len(traces)], request_id=f"r{i}", domain="sql" if i % 10 == 0 else "code"))
    uniform = [t.domain for t in buffer.sample(4000, random.Random(0))]
    balanced = [t.domain for t in buffer.sample(4000, random.Random(0), by_domain=True)]
    assert 0.08 < uniform.count("sql") / 4000 < 0.12 and 0.47 < balanced.count("sql") / 4000 < 0.53
    assert buffer.sample(3, random.Random(0), recent=5, by_domain=True) != []
    assert TraceBuffer(capacity_bytes=10).sample(3, random.Random(0), by_domain=True) == []


def test_two_writers_of_one_shard_name_do_not_collide(traces, tmp_path):
    """Each writer has its own temporary file (the replay cache is filled by benchmark runs side by side)."""
    import threading

    from tandem.flywheel.buffer import write_shard

    errors = []

    def write():
        try:
            write_shard(tmp_path / "traces-000001.parquet", traces)
        except Exception as e:  # noqa: BLE001 - the test reports any failure
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and [p.name for p in tmp_path.iterdir()] == ["traces-000001.parquet"]
    assert [t.request_id for t in load_traces(tmp_path)] == [t.request_id for t in traces]


def test_a_batch_mixes_the_newest_traces_with_balanced_replay(traces):
    """recent_share 0.5 of a batch of 4: two traces from the newest recent_window, two balanced over domains."""
    import dataclasses

    from tandem.flywheel.trainer import FlywheelConfig, draw_batch

    buffer = TraceBuffer(capacity_bytes=1 << 30)
    for i in range(40):
        buffer.put(dataclasses.replace(traces[i % len(traces)], request_id=f"r{i}", domain="code" if i < 36 else "sql"))
    rng = random.Random(0)
    cfg = FlywheelConfig(batch_size=4, recent_share=0.5, recent_window=4, sample="domains")
    batches = [draw_batch(buffer, cfg, rng) for _ in range(500)]
    assert all(len(b) == 4 and all(t.request_id in {"r36", "r37", "r38", "r39"} for t in b[:2]) for b in batches)
    balanced = [t.domain for b in batches for t in b[2:]]
    assert 0.45 < balanced.count("sql") / len(balanced) < 0.55  # 4 sql among 40, drawn half the time
    plain = draw_batch(buffer, FlywheelConfig(batch_size=4), random.Random(0))  # recent_share 0: the draw it always was
    assert [t.request_id for t in plain] == [t.request_id for t in buffer.sample(4, random.Random(0))]
    with pytest.raises(InvalidParameterError):
        FlywheelConfig(recent_share=1.5)
