"""`tandem rl --compare` end to end on the tiny model: JSON summary, sweep, plot, checkpoint + resume; rewards next to
exact accuracy, async with math-verify, export of the trained policy."""
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tandem.cli import main
from tandem.rl.command import env_config
from tandem.rl.envs import ReasoningEnv


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


def answering_model(directory: Path, answer: str) -> str:
    """A tiny qwen2 (untied head) whose every completion is "<answer>ANSWER</answer>" repeated: one added token spells it,
    the layers add nothing to the residual (o_proj and down_proj zero), every embedding is the same unit vector and
    only that token's head row is aligned with it (logit 400 against 0: at T = 1 any other token has probability
    < 1e-170)."""
    from safetensors.torch import load_file, save_file

    from tandem.models.tiny import byte_tokenizer, make_tiny_model

    make_tiny_model(directory, "qwen2", seed=0)
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([f"<answer>{answer}</answer>"])
    tokenizer.save_pretrained(directory)
    token = tokenizer.convert_tokens_to_ids(f"<answer>{answer}</answer>")
    tensors = load_file(str(directory / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    tensors["model.norm.weight"].fill_(1.0)
    tensors["model.embed_tokens.weight"].zero_()[:, 0] = 1.0
    tensors["lm_head.weight"].zero_()[token, 0] = 50.0
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def one_task_env(held_out: int) -> ReasoningEnv:
    return ReasoningEnv(env_config("basic_arithmetic", "", demonstration=False), seed=0, held_out_size=held_out)


RUN = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "2", "--eval-every", "1",
       "--task", "basic_arithmetic", "--no-demonstration"]


def test_async_run_scores_with_math_verify(tmp_path):
    """math-verify's timeouts use signal.alarm, which works on the main thread only: async runs scored on the update
    thread and raised. Every completion answers the held-out set's most common answer, so the known rewards are the
    share of problems with that answer (math-verify's 0/1 reward and exact accuracy agree)."""
    env = one_task_env(16)
    answer, count = Counter(p.answer for p in env.held_out).most_common(1)[0]
    out = tmp_path / "rl.json"
    assert main(["rl", "--model", answering_model(tmp_path / "m", answer), "--async", "--reward", "math_verify", "--eval-problems", "16",
                 "--json", str(out)] + RUN) == 0
    result = json.loads(out.read_text())
    assert [(e["greedy"], e["greedy_exact"], e["sampled"], e["sampled_exact"]) for e in result["evals"]] == [(count / 16,) * 4] * 3
    for h in result["history"]:
        hits = sum(p.answer == answer for p in env.step_problems(h["step"], 2)) / 2
        assert h["reward_mean"] == h["exact_mean"] == hits


def test_reward_with_partial_credit_and_exact_accuracy_side_by_side(tmp_path, capsys):
    """Every completion answers 14: reasoning-gym's scorer gives 1.0 where the reference is 14 and 0.5 where it is 4 (a
    substring); exact accuracy counts the 1.0s only. Both are reported, in the step lines and the JSON."""
    env = one_task_env(32)
    scores = [env.score(p.task, "14", p.entry) for p in env.held_out]
    reward, exact = sum(scores) / 32, sum(s == 1.0 for s in scores) / 32
    assert (reward, exact) == (2.5 / 32, 1 / 32)  # held-out references: one 14, three 4s
    out = tmp_path / "rl.json"
    assert main(["rl", "--model", answering_model(tmp_path / "m", "14"), "--eval-problems", "32", "--json", str(out),
                 "--plot", str(tmp_path / "rl.png")] + RUN) == 0
    result = json.loads(out.read_text())
    assert [(e["greedy"], e["greedy_exact"]) for e in result["evals"]] == [(reward, exact)] * 3
    for h in result["history"]:
        step_scores = [env.score(p.task, "14", p.entry) for p in env.step_problems(h["step"], 2)]
        assert (h["reward_mean"], h["exact_mean"]) == (sum(step_scores) / 2, sum(s == 1.0 for s in step_scores) / 2)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    assert [(line["reward_mean"], line["exact_mean"]) for line in lines] == [(h["reward_mean"], h["exact_mean"]) for h in result["history"]]


def test_the_trained_policy_is_exported_as_a_hugging_face_model(tiny_llama, tmp_path):
    """`tandem rl --export` and `tandem export CHECKPOINT` write the same directory: the learner's weights under HF names
    (tandem's loader reads back exactly the checkpoint's policy, which training moved off the source weights)."""
    from safetensors.torch import load_file

    from tandem.models.loader import load_transformer

    ckpt, exported, again = tmp_path / "ckpt", tmp_path / "export", tmp_path / "again"
    assert main(["rl", "--model", tiny_llama, "--steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--max-tokens", "6",
                 "--eval-problems", "0", "--lr", "1e-3", "--reward", "tests.rl.test_grpo:parity_reward", "--task", "basic_arithmetic",
                 "--no-demonstration", "--checkpoint", str(ckpt), "--export", str(exported)]) == 0
    assert main(["export", str(ckpt), "--out", str(again)]) == 0
    assert {f.name for f in exported.iterdir()} == {f.name for f in again.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert all((exported / f.name).read_bytes() == (again / f.name).read_bytes() for f in exported.iterdir())
    policy = load_file(str(ckpt / "policy.safetensors"))
    params = dict(load_transformer(exported).named_parameters())
    assert set(policy) == set(params) and all(torch.equal(params[n], policy[n]) for n in policy)
    source = dict(load_transformer(tiny_llama).named_parameters())
    assert not torch.equal(params["blocks.0.attn.qkv.weight"], source["blocks.0.attn.qkv.weight"])
    assert main(["export", str(ckpt), "--out", str(again)]) == 1  # never overwrites
