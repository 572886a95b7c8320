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


def test_simulate_rollout_with_a_calibration_replays_the_run(tmp_path):
    """A calibration whose machine costs 1 s per forward (overhead only): the hand-made run's plain rollout (4 steps)
    is predicted at 4 s, the always-accepted chain at 2 steps (2.0x); both measured figures come from the run."""
    from dataclasses import replace

    from tandem.sim.calibration import Calibration, save_calibration
    from tandem.sim.report import model_work
    from tandem.sim.roofline import Machine

    work = replace(model_work("smollm2-135m", "fp32"), dense_params=1.0, kv_bytes_per_token=0.0, attn_flops_per_token_ctx=0.0)
    cal = Calibration("m", {"cpu": "test"}, work, Machine("m", bandwidth=1e30, peak_flops=1e30, overhead_s=1.0))
    save_calibration(cal, tmp_path / "cal.json")
    run = {"config": {"num_draft_tokens": 2}, "history": [{
        "rollout_s": {"ar": 8.0, "x@fixed": 2.0}, "rollout_tokens": {"ar": 8, "x@fixed": 8}, "acceptance_length": {"ar": 1.0, "x@fixed": 3.0},
        "completion_lengths": {"ar": [4, 4], "x@fixed": [4, 4]}, "prompt_tokens_mean": 0.0, "profiles": {"ar": [[2, 2.0, 0.0]] * 4}}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "cmp.json"
    assert main(["simulate", "--rollout", str(tmp_path / "run.json"), "--calibration", str(tmp_path / "cal.json"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["plain_predicted_s"] == 4.0 and result["engines"][0]["predicted_speedup"] == 2.0
    assert result["engines"][0]["measured_speedup"] == 4.0 and result["cost_model"] == "calibration of m on test"
