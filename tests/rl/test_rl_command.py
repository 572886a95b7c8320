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
    for row in sweep.values():  # token rates over ar's (not the first engine's), rounded as reported
        assert list(row) == ["suffix", "ar"]
        for r in row.values():
            assert r["tokens_per_s"] == round(r["tokens"] / r["wall_s"], 2) and r["speedup"] == round(r["tokens_per_s"] / row["ar"]["tokens_per_s"], 3)


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
    history = result["history"]  # each drafter's step: its rollout + the shared update and target sync + its own re-sync
    rollout = {d: sum(h["rollout_s"][d] for h in history) for d in summary["per_drafter"]}
    shared = sum(h["train_s"] for h in history) + sum(h["sync"]["target"] for h in history)
    step = {d: rollout[d] + shared + sum(h["sync"].get(f"resync/{d}", 0.0) + (h["sync"]["publish/eagle"] if d == "eagle" else 0.0) for h in history)
            for d in rollout}
    assert summary["generation_share"] == pytest.approx(rollout["ar"] / step["ar"], abs=1e-4)
    for d, row in summary["per_drafter"].items():
        assert row["rollout_speedup"] == pytest.approx(rollout["ar"] / rollout[d], abs=1e-3) and row["step_speedup"] == pytest.approx(step["ar"] / step[d], abs=1e-3)
    assert set(result["sweep"]) == {"1", "4"} and set(result["sweep"]["4"]) == {"ar", "ngram", "self_draft", "eagle"}
    for row in result["sweep"].values():  # the sweep's speedup is a ratio of token rates
        for r in row.values():
            assert r["speedup"] == round(r["tokens_per_s"] / row["ar"]["tokens_per_s"], 3)
    tokens = {d: sum(h["rollout_tokens"][d] for h in history) for d in rollout}
    for d, row in summary["per_drafter"].items():
        assert row["rollout_rate_speedup"] == pytest.approx(tokens[d] / rollout[d] / (tokens["ar"] / rollout["ar"]), abs=1e-3)
    assert [e["step"] for e in result["evals"]] == [0, 1, 2]
    assert png.stat().st_size > 10_000 and (ckpt / "state.json").exists() and (ckpt / "eagle" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(args[:4] + ["3", "--resume", str(ckpt), "--json", str(out), "--drafters", "ar,ngram,self_draft,eagle", "--compare",
                             "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "6", "--eval-problems", "4", "--eval-every", "1",
                             "--sweep", "1,4", "--lr", "1e-4", "--task", "basic_arithmetic,chain_sum", "--no-demonstration"]) == 0
    resumed = json.loads(out.read_text())
    assert [h["step"] for h in resumed["history"]] == [0, 1, 2]  # steps 0, 1 restored, step 2 run (--steps is the total)
