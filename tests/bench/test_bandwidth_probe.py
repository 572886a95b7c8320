"""The bandwidth probes around each roofline row of `bench forward`: steady within 15 %, the row divides by their mean,
the report flags an unsteady row and --strict-probe refuses it. A fake probe (a callable) stands in for the 512 MB read."""
import pytest

from tandem.bench.kernels.forward import run_forward_bench, unsteady_rows, weight_bytes_per_token
from tandem.bench.machine import BandwidthProbe, bracketed
from tandem.bench.report.report_write import headline_rows, markdown
from tandem.cli import main
from tandem.errors import UnsteadyMachineError

MACHINE = {"cpu": "AMD EPYC 9R45", "cores": 2, "threads": 2, "torch": "2.13.0+cpu", "python": "3.11.7", "date": "2026-12-06 18:00 UTC"}
FORWARD = {"ar_tokens_per_s": 56.64, "roofline_tokens_per_s": 68.46, "fraction_of_roofline": 0.827, "memory_bandwidth_gbps": 36.8,
           "weight_bytes_per_token": 537_900_000, "forward_ms_per_token": 15.2, "cost_ratio": {"1": 1.0, "5": 0.99}}

AR_ROW = "plain decoding, batch 1, fp32, vs the roofline"


def fake_probe(*values):
    """A probe returning `values` in turn (GB/s), recording each call in `calls`."""
    it = iter(values)

    def probe():
        probe.calls.append("probe")
        return next(it)

    probe.calls = []
    return probe


def test_bracketed_probes_before_and_after_the_section():
    probe = fake_probe(10.0, 11.0)
    result, p = bracketed(lambda: probe.calls.append("section") or "done", probe)
    assert (result, probe.calls) == ("done", ["probe", "section", "probe"])
    assert p == BandwidthProbe(10.0, 11.0)
    assert p.as_dict() == {"before_gbps": 10.0, "after_gbps": 11.0, "mean_gbps": 10.5, "ratio": 1.1, "steady": True}


def test_a_probe_moving_20_percent_is_unsteady_either_way():
    assert BandwidthProbe(10.0, 12.0).as_dict() == {"before_gbps": 10.0, "after_gbps": 12.0, "mean_gbps": 11.0, "ratio": 1.2, "steady": False}
    assert BandwidthProbe(10.0, 8.0).steady is False
    assert BandwidthProbe(10.0, 9.0).steady is True


def test_forward_rows_divide_by_the_mean_of_their_probes_and_flag_a_20_percent_move(tiny_llama):
    probe = fake_probe(10.0, 11.0, 10.0, 12.0)  # plain decoding: +10 %, the 1-token forward: +20 %
    result = run_forward_bench(tiny_llama, max_tokens=4, with_hf=False, probe=probe)
    assert len(probe.calls) == 4
    assert result["bandwidth_probes"] == {
        "ar": {"before_gbps": 10.0, "after_gbps": 11.0, "mean_gbps": 10.5, "ratio": 1.1, "steady": True},
        "forward": {"before_gbps": 10.0, "after_gbps": 12.0, "mean_gbps": 11.0, "ratio": 1.2, "steady": False}}
    from tandem.llm import LLM

    weight_bytes = weight_bytes_per_token(LLM(model=tiny_llama).target)
    assert result["weight_bytes_per_token"] == weight_bytes
    assert result["memory_bandwidth_gbps"] == 10.5
    assert result["roofline_tokens_per_s"] == round(10.5e9 / weight_bytes, 2)
    at_mean = weight_bytes / 11.0e9 * 1000 / result["cost_ms"][1]  # the forward row's own probes, not plain decoding's
    # the fraction is rounded to 3 decimals and cost_ms to the microsecond: on a ~0.1 ms tiny forward that rounding alone
    # moves at_mean by up to 0.0005 / cost_ms of itself
    assert result["forward_fraction_of_roofline"] == pytest.approx(at_mean, rel=0.0005 / result["cost_ms"][1], abs=5e-4)
    assert unsteady_rows(result) == ["row '1-token forward vs the roofline': memory bandwidth 10.0 GB/s before, 12.0 GB/s after "
                                     "(+20%, beyond the 15% tolerance)"]


def test_strict_probe_passes_a_10_percent_move_and_refuses_a_20_percent_one_naming_the_row(tiny_llama):
    probe = fake_probe(10.0, 11.0, 10.0, 12.0)
    with pytest.raises(UnsteadyMachineError, match=r"row '1-token forward vs the roofline': .*\+20%.*--strict-probe refuses it"):
        run_forward_bench(tiny_llama, max_tokens=4, with_hf=False, strict_probe=True, probe=probe)
    assert len(probe.calls) == 4  # plain decoding (+10 %) went through; the forward row was refused


def test_cli_strict_probe_exits_1_with_the_row_named(tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr("tandem.bench.kernels.forward.probe_bandwidth_gbps", fake_probe(10.0, 8.0))
    assert main(["bench", "forward", "--model", tiny_llama, "--max-tokens", "4", "--no-hf", "--strict-probe"]) == 1
    err = capsys.readouterr().err
    assert "error: row 'plain decoding vs the roofline': memory bandwidth 10.0 GB/s before, 8.0 GB/s after (-20%" in err


def _forward(before, after):
    return FORWARD | {"bandwidth_probes": {"ar": BandwidthProbe(before, after).as_dict()}}


def test_the_report_marks_an_unsteady_roofline_row_and_says_why_under_the_table():
    results = {"machine": MACHINE, "forward": _forward(10.0, 12.0), "forward_command": "f"}
    row = {r.claim: r for r in headline_rows(results)}[AR_ROW]
    assert row.ratio == "0.83 of the roofline (68.46 tok/s = 36.8 GB/s / 537.9 MB per token) !"
    text = markdown(results)
    assert f"| {AR_ROW} | 56.64 tok/s | {row.ratio} | `f` |" in text
    assert ("- row 'plain decoding vs the roofline': memory bandwidth 10.0 GB/s before, 12.0 GB/s after (+20%, beyond the 15% tolerance)"
            in text)


def test_the_report_leaves_a_steady_row_unmarked():
    results = {"machine": MACHINE, "forward": _forward(10.0, 11.0), "forward_command": "f"}
    assert {r.claim: r for r in headline_rows(results)}[AR_ROW].ratio.endswith("MB per token)")
    assert "!" not in markdown(results)


def test_bench_report_passes_strict_probe_to_bench_forward():
    from tandem.bench.report.report import PeerEnv, ReportConfig, plan

    strict = plan(ReportConfig(quick=True, strict_probe=True), PeerEnv(None, False, None))
    assert strict["forward"]["strict_probe"] is True
    assert strict["commands"]["forward"] == "tandem bench forward --model smollm2-135m --max-tokens 16 --no-hf --strict-probe --threads 2"
    assert plan(ReportConfig(quick=True), PeerEnv(None, False, None))["forward"]["strict_probe"] is False


def test_cli_without_strict_probe_keeps_the_run_and_flags_the_row(tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr("tandem.bench.kernels.forward.probe_bandwidth_gbps", fake_probe(10.0, 12.0, 10.0, 11.0))
    assert main(["bench", "forward", "--model", tiny_llama, "--max-tokens", "4", "--no-hf"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "! flagged: row 'plain decoding vs the roofline': memory bandwidth 10.0 GB/s before, 12.0 GB/s after (+20%, beyond the 15% tolerance); "
        "its fraction of the roofline is not comparable")
