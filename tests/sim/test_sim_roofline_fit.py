"""Roofline cost model and its least-squares fit (synthetic timings with a known answer)."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.sim.fit import Timing, fit_machine, measured_rates_report
from tandem.sim.roofline import Machine, ModelWork, forward_seconds, is_memory_bound

WORK = ModelWork("toy", dense_params=100e6, bytes_per_param=4.0, kv_bytes_per_token=20e3, attn_flops_per_token_ctx=4e4)
TRUE = Machine("true", bandwidth=25e9, peak_flops=60e9, overhead_s=0.004, per_token_s=2e-4)
GRID = [(b, t, c) for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8) for c in (32, 256)]


def test_forward_seconds_is_the_roofline():
    # batch 1, 1 token, no context: 400 MB / 25 GB/s = 16 ms; 200 MFLOP + attention / 60 GFLOP/s ~ 3.3 ms
    expected = 0.004 + 2e-4 + (400e6 + 20e3) / 25e9
    assert forward_seconds(WORK, TRUE, 1, 1, 0) == pytest.approx(expected, rel=1e-12)
    assert is_memory_bound(WORK, TRUE, 1, 1, 0)
    assert not is_memory_bound(WORK, TRUE, 16, 8, 32)  # 128 tokens x 2 FLOP x 100M >> ridge 2.4 FLOP/B x 400 MB


def test_fit_recovers_a_known_machine_exactly():
    timings = [Timing(b, t, c, forward_seconds(WORK, TRUE, b, t, c)) for b, t, c in GRID]
    report = fit_machine(WORK, timings)
    m = report.machine
    assert m.bandwidth == pytest.approx(TRUE.bandwidth, rel=1e-6)
    assert m.peak_flops == pytest.approx(TRUE.peak_flops, rel=1e-6)
    assert m.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-6)
    assert m.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert report.max_rel_error < 1e-7


def test_fit_tolerates_noise():
    noise = [1.0 + 0.03 * ((i * 7919) % 11 - 5) / 5 for i in range(len(GRID))]  # deterministic +-3 %
    timings = [Timing(b, t, c, forward_seconds(WORK, TRUE, b, t, c) * n) for (b, t, c), n in zip(GRID, noise)]
    m = fit_machine(WORK, timings).machine
    assert m.bandwidth == pytest.approx(TRUE.bandwidth, rel=0.1)
    assert m.peak_flops == pytest.approx(TRUE.peak_flops, rel=0.1)


def test_fit_needs_enough_points():
    with pytest.raises(InvalidParameterError):
        fit_machine(WORK, [Timing(1, 1, 0, 0.01)] * 3)



def test_measured_rates_report_keeps_the_rates_with_the_fastest_timing_as_overhead():
    # batch 1, 1 token, no context is memory-bound: 16.0008 ms of weights + KV at 25 GB/s, over an overhead of 16 ms
    timings = [Timing(1, 1, 0, 0.016), Timing(1, 1, 0, 0.032)]
    report = measured_rates_report(WORK, timings, bandwidth=25e9, peak_flops=60e9, name="flat")
    assert report.machine == Machine("flat", 25e9, 60e9, overhead_s=0.016, source="measured rates; no roofline fit")
    errors = (0.0320008 / 0.016 - 1, 0.0320008 / 0.032 - 1)  # 1.00005 and 0.000025
    assert report.max_rel_error == pytest.approx(errors[0], rel=1e-9)
    assert report.rms_rel_error == pytest.approx(((errors[0] ** 2 + errors[1] ** 2) / 2) ** 0.5, rel=1e-9)
    assert report.points == 2

def test_moe_touches_more_experts_with_more_tokens():
    moe = ModelWork("moe", 1e9, 1.0, 0.0, 0.0, expert_params=1e8, num_experts=128, experts_per_token=8)
    assert moe.experts_touched(1) == pytest.approx(8.0)
    assert moe.experts_touched(1000) == pytest.approx(128.0, rel=1e-6)
    assert moe.bytes_moved(1, 6, 0) > moe.bytes_moved(1, 1, 0) * 2  # verify of 6 tokens reads far more experts
