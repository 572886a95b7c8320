"""`tandem bench batch` end to end on a tiny model: rows for every runner and batch size, predictions
from a calibration record, the plot written."""
import json

import pytest

from tandem.bench.speculation.batch import predicted_rate
from tandem.cli import main
from tandem.engine.calibrate import CalibrationGrid, calibrate
from tandem.sim.calibration import save_calibration
from tandem.sim.speculative import DraftCost
from tiny_helpers import load_packed


def test_predicted_rate_known_answer():
    forward = lambda b, t: 0.01 + 0.001 * b * t  # noqa: E731
    # batch 2, k = 2, reach (0.5, 0.25): E = 1.75 tokens each; 2 x 3 tokens verified; draft 1 ms + 1 ms per depth
    rate = predicted_rate(forward, DraftCost(0.001, 0.001), 2, 2, [0.5, 0.25, 0.1])
    assert rate == pytest.approx(2 * 1.75 / (0.003 + 0.016))


def test_bench_batch_on_a_tiny_model(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": f"{d} a b a b a b"}) for d in ("code", "sql")))
    model = load_packed(tiny_llama)
    calib = calibrate(model, tiny_llama, {}, grid=CalibrationGrid((1, 2), (1, 3), (8,), 1, (1,), (1,)))
    save_calibration(calib, tmp_path / "calib.json")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "batch", "--model", tiny_llama, "--drafters", "ngram", "--batch-sizes", "1,2", "--ks", "2",
                 "--max-tokens", "6", "--prompts", str(prompts), "--calibration", str(tmp_path / "calib.json"),
                 "--json", str(out), "--plot", str(png), "--threads", "1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["runner"], r["batch"]) for r in rows} == {(n, b) for n in ("plain", "ngram k=2", "ngram controller") for b in (1, 2)}
    assert all(r["tokens"] == 6 * r["batch"] and "predicted_speedup" in r for r in rows)
    assert all(r["speedup"] == 1.0 and r["predicted_speedup"] == 1.0 for r in rows if r["runner"] == "plain")
    assert "controller" in next(r for r in rows if r["runner"] == "ngram controller")
    assert png.stat().st_size > 1000


def test_predicted_rate_counts_steps_without_a_draft():
    forward = lambda b, t: 0.01 * t  # noqa: E731
    # batch 1, half the steps draft (2 tokens, both accepted when drafted): E = 1 + 0.5 x 2 = 2 tokens,
    # time = 0.5 x 0.03 + 0.5 x 0.01 = 0.02 s
    assert predicted_rate(forward, DraftCost(), 1, 2, [1.0, 1.0], fill=0.5) == pytest.approx(2 / 0.02)
