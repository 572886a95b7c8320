"""N replicas over one offered load (tandem.sim.replicas): hand-computed values on a linear forward cost.

forward(b, t, c) = 0.01 + 0.001 * b * t seconds, acceptance [0.5] (E(1) = 1.5 tokens per step), no draft cost,
requests of 10 tokens, 0.1 s routing per request.
"""
import json

import pytest

from tandem.cli import main
from tandem.errors import InvalidParameterError
from tandem.sim.replicas import project, replica_table, split_load
from tandem.sim.report import SimulateConfig, simulate_batches


def forward(b, t, c):
    return 0.01 + 0.001 * b * t


def test_load_splits_evenly_with_the_first_replicas_one_more():
    assert split_load(8, 3) == [3, 3, 2]
    assert split_load(2, 4) == [1, 1, 0, 0]
    with pytest.raises(InvalidParameterError):
        split_load(0, 2)


def test_one_replica_plain_and_speculative_by_hand():
    plain = project(forward, 8, 1, 10, 0, [0.5], 1, routing_s=0.1, speculate=False)
    # step 0.018 s for 8 sequences: a request takes 0.1 + 10 * 0.018 = 0.28 s; 8 * 10 tokens / 0.28 s
    assert (plain.batch, plain.best_k) == (8, 0)
    assert plain.latency_s == pytest.approx(0.28) and plain.tok_s == pytest.approx(80 / 0.28)
    spec = project(forward, 8, 1, 10, 0, [0.5], 1, routing_s=0.1)
    # k = 1: step 0.01 + 0.001 * 8 * 2 = 0.026 s for 1.5 tokens each (57.7 > 55.6 tokens/s per sequence)
    assert spec.best_k == 1
    assert spec.latency_s == pytest.approx(0.1 + 10 * 0.026 / 1.5) and spec.tok_s == pytest.approx(80 / (0.1 + 10 * 0.026 / 1.5))


def test_two_replicas_halve_the_batch_and_add_their_rates():
    plain = project(forward, 8, 2, 10, 0, [0.5], 1, routing_s=0.1, speculate=False)
    # each: batch 4, step 0.014 s, latency 0.24 s, 40 tokens / 0.24 s
    assert plain.batch == 4 and plain.latency_s == pytest.approx(0.24) and plain.tok_s == pytest.approx(2 * 40 / 0.24)
    spec = project(forward, 8, 2, 10, 0, [0.5], 1, routing_s=0.1)
    assert spec.best_k == 1 and spec.latency_s == pytest.approx(0.1 + 10 * 0.018 / 1.5)  # 0.22 s


def test_an_uneven_split_reports_the_busiest_replica_and_sums_every_replica():
    plain = project(forward, 8, 3, 10, 0, [0.5], 1, routing_s=0.1, speculate=False)
    # batches 3, 3, 2: latencies 0.23, 0.23, 0.22 s
    assert plain.batch == 3 and plain.latency_s == pytest.approx(0.23)
    assert plain.tok_s == pytest.approx(2 * 30 / 0.23 + 20 / 0.22)


def test_replicas_beyond_the_load_stay_idle():
    plain = project(forward, 8, 16, 10, 0, [0.5], 1, routing_s=0.1, speculate=False)
    assert plain.batch == 1 and plain.tok_s == pytest.approx(8 * 10 / (0.1 + 10 * 0.011))


def test_routing_cost_lowers_throughput_of_the_closed_loop():
    fast = project(forward, 8, 2, 10, 0, [0.5], 1, routing_s=0.0, speculate=False)
    assert fast.tok_s == pytest.approx(2 * 4 / 0.014)  # no routing: each replica's plain rate, batch / step
    with pytest.raises(InvalidParameterError):
        project(forward, 8, 2, 10, 0, [0.5], 1, routing_s=-1.0)


def test_one_replica_without_routing_matches_the_per_batch_table():
    config = SimulateConfig(model="qwen3-8b", hardware="h200", batch_sizes=(64,))
    [row] = simulate_batches(config)
    [one] = replica_table(config, [1], 64, 256)
    assert one["plain_tok_s"] == row["plain_tok_s"] and one["best_k"] == row["best_k"]
    assert one["spec_speedup"] == pytest.approx(row["speedup"], abs=1e-3) and one["memory_bound"] == row["memory_bound"]


def test_simulate_replicas_on_the_command_line(tmp_path):
    out = tmp_path / "replicas.json"
    assert main(["simulate", "--model", "qwen3-8b", "--hardware", "h100", "--replicas", "1,2,4", "--load", "256", "--context", "2048",
                 "--output-tokens", "128", "--routing-ms", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["replicas"] for r in rows] == [1, 2, 4] and [r["batch_per_replica"] for r in rows] == [256, 128, 64]
    # 7.57 B bf16 parameters (15.1 GB) + 256 x 2048 tokens x 144 KiB of KV (77.3 GB) = 92.4 GB: more than one H100's 80 GB; 128 fit
    assert [r["fits"] for r in rows] == [False, True, True]
    assert rows[0]["plain_scaling"] == 1.0
    assert rows[1]["plain_scaling"] == pytest.approx(rows[1]["plain_tok_s"] / rows[0]["plain_tok_s"], abs=2e-3)
