"""`tandem rl --compare` end to end on the tiny model: JSON summary, sweep, plot, checkpoint + resume."""
import json

import pytest

from tandem.cli import main


def test_sweep_speedups_when_plain_is_not_the_first_engine(tiny_llama, tmp_path):
    out = tmp_path / "rl.json"
    assert main(["rl", "--model", tiny_llama, "--steps", "1", "--drafters", "suffix,ar", "--compare", "--prompts-per-step", "2",
                 "--group-size", "2", "--max-tokens", "6", "--eval-problems", "0", "--sweep", "1,4", "--json", str(out),
                 "--task", "basic_arithmetic,chain_sum", "--no-demonstration"]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert all(row["ar"]["speedup"] == 1.0 for row in sweep.values())
    assert all(row["suffix"]["speedup"] == pytest.approx(row["suffix"]["tokens_per_s"] / row["ar"]["tokens_per_s"], rel=0.01) for row in sweep.values())


def test_rl_compare_writes_summary_sweep_plot_and_checkpoint(tiny_llama, tmp_path, capsys):
    out, png, ckpt = tmp_path / "rl.json", tmp_path / "rl.png", tmp_path / "ckpt"
    args = ["rl", "--model", tiny_llama, "--steps", "2", "--drafters", "ar,ngram,self_draft,eagle", "--compare", "--prompts-per-step", "2",
            "--group-size", "2", "--max-tokens", "6", "--eval-problems", "4", "--eval-every", "1", "--sweep", "1,4",
            "--json", str(out), "--plot", str(png), "--checkpoint", str(ckpt), "--lr", "1e-4",
            "--task", "basic_arithmetic,chain_sum", "--no-demonstration"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert set(summary["per_drafter"]) == {"ar", "ngram", "self_draft", "eagle"} and summary["steps"] == 2
    assert summary["per_drafter"]["ar"]["rollout_speedup"] == 1.0 and summary["per_drafter"]["ar"]["step_speedup"] == 1.0
    assert 0 < summary["generation_share"] < 1
    assert set(result["sweep"]) == {"1", "4"} and set(result["sweep"]["4"]) == {"ar", "ngram", "self_draft", "eagle"}
    for row in result["sweep"].values():  # the sweep's speedup is a ratio of token rates
        for r in row.values():
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / row["ar"]["tokens_per_s"], rel=0.01)
    assert summary["per_drafter"]["ar"]["rollout_rate_speedup"] == 1.0
    assert [e["step"] for e in result["evals"]] == [0, 1, 2]
    assert png.stat().st_size > 10_000 and (ckpt / "state.json").exists() and (ckpt / "eagle" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(args[:4] + ["3", "--resume", str(ckpt), "--json", str(out), "--drafters", "ar,ngram,self_draft,eagle", "--compare",
                             "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "6", "--eval-problems", "4", "--eval-every", "1",
                             "--sweep", "1,4", "--lr", "1e-4", "--task", "basic_arithmetic,chain_sum", "--no-demonstration"]) == 0
    resumed = json.loads(out.read_text())
    assert [h["step"] for h in resumed["history"]] == [0, 1, 2]  # steps 0, 1 restored, step 2 run (--steps is the total)
