"""bench flywheel_costs: the per-step figures are the rows' sums over decode steps, and a short real run reports
every measurement per round (slow: the real SmolLM2 target and the shipped general head)."""
import json

import pytest

from tandem.bench.flywheel.flywheel_costs import HEAD, main, per_step
from tandem.flywheel.setups import StreamResult


def test_per_step_divides_the_rows_sums_by_the_decode_steps():
    rows = [{"acceptance_length": 2.0, "drafted_per_step": 3.0, "verify_s": 0.4, "draft_s": 0.04, "prefill_s": 0.1},
            {"acceptance_length": 4.0, "drafted_per_step": 4.0, "verify_s": 0.2, "draft_s": 0.02, "prefill_s": 0.3}]
    result = StreamResult(rows, [[1] * 8, [1] * 8], output_tokens=16, seconds=2.0)
    # 8 tokens at 2.0 a step + 8 at 4.0 a step = 6 decode steps
    assert per_step(result, 8) == {"tokens_per_s": 8.0, "acceptance": 3.0, "drafted_per_step": 3.5, "verify_ms_per_step": 100.0,
                                   "draft_ms_per_step": 10.0, "prefill_share": 0.2}


@pytest.mark.slow
@pytest.mark.skipif(not (HEAD / "model.safetensors").is_file(), reason="no shipped general head")
def test_a_short_run_reports_each_measurement_per_round(tmp_path):
    out = tmp_path / "costs.json"
    assert main(["--requests", "2", "--rounds", "2", "--max-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["threads"] == 1
    assert len(report["overhead"]) == len(report["interference"]) == len(report["learning"]) == 2
    for row in report["learning"]:
        assert row["tokens_per_s_ratio"] == pytest.approx(row["flywheel"]["tokens_per_s"] / row["static"]["tokens_per_s"], abs=2e-3)
        assert row["static"]["drafted_per_step"] > 0 and 1.0 <= row["static"]["acceptance"] <= 9.0
