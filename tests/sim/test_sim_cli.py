"""`tandem simulate`: the paper's figures and a per-batch table through the command line."""
import json

from tandem.cli import main


def test_simulate_paper_json(tmp_path):
    out = tmp_path / "paper.json"
    assert main(["simulate", "--paper", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert abs(result["qwen3_8b"]["step_at_1.8x_f=0.65"] - 1.41) < 0.05
    assert set(result["qwen3_235b_gb200"]) >= {"rollout_speedup", "async_step_speedup", "sync_step_speedup"}


def test_simulate_turns_speculation_off_past_the_ridge(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["simulate", "--model", "qwen3-8b", "--hardware", "h200", "--batch-sizes", "1,1024", "--context", "128",
                 "--json", str(out)]) == 0
    small, large = json.loads(out.read_text())
    assert small["memory_bound"] and small["best_k"] > 0 and small["speedup"] > 1.5
    assert not large["memory_bound"] and large["best_k"] == 0 and large["speedup"] == 1.0
