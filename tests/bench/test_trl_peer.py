"""`tandem bench rl-trl`: the problem export and the report from known inputs (fast); both sides end to end when
TRL's venv exists (slow)."""
import json

import pytest

from tandem.bench.peers.trl_peer import (
    TrlCompareConfig,
    check_drafter,
    compare,
    ensure_trl_venv,
    export_records,
    markdown,
    run_rl_trl_bench,
    tandem_side,
    trl_command,
    trl_side,
    trl_venv,
)
from tandem.errors import InvalidParameterError
from tandem.rl.envs import DEMONSTRATION, INSTRUCTION, content_key


def test_export_holds_the_trainers_problems_in_step_order_and_the_held_out_set():
    cfg = TrlCompareConfig(steps=3, prompts_per_step=2, group_size=4, micro_batch=4, eval_problems=8).grpo()
    records = json.loads(json.dumps(export_records(cfg)))  # all of it survives JSON
    meta, train = records[0], [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "held_out"]
    assert meta["kind"] == "meta" and meta["train_seed_base"] == 0 and meta["size"] == 1 << 24 and meta["steps"] == 3
    assert meta["env"]["tasks"] == ["basic_arithmetic", "chain_sum", "gsm_symbolic"]
    assert [(r["step"], r["slot"]) for r in train] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert len(held) == 8 and [r["slot"] for r in held] == list(range(8))
    # seed 0's first held-out problem (generator seed 2^24, index 0) and the prompt the engine and TRL both render
    assert held[0]["entry"]["question"] == "Calculate 6 - 2." and held[0]["answer"] == "4" and held[0]["task"] == "basic_arithmetic"
    assert held[0]["messages"] == [{"role": "user", "content": f"{DEMONSTRATION[0]}\n\n{INSTRUCTION}"},
                                   {"role": "assistant", "content": DEMONSTRATION[1]},
                                   {"role": "user", "content": f"Calculate 6 - 2.\n\n{INSTRUCTION}"}]
    assert [r["index"] for r in train[:2]] == [0, 4]  # slot k tries indices 4k.. (GRPOTrainer.step_problems), the first not held out
    held_keys = {content_key(r["task"], r["entry"]["question"]) for r in held}
    assert not held_keys & {content_key(r["task"], r["entry"]["question"]) for r in train}


def test_export_includes_the_prompt_token_ids_when_given_a_tokenizer(tiny_llama):
    from tandem.llm import load_tokenizer

    cfg = TrlCompareConfig(steps=1, prompts_per_step=2, group_size=2, micro_batch=2, eval_problems=2).grpo()
    tok = load_tokenizer(tiny_llama)
    records = export_records(cfg, tok)
    for r in records[1:]:
        assert r["prompt_ids"] == list(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))


def test_config_refuses_a_micro_batch_that_does_not_divide_the_rollout_batch_and_maps_loss_settings():
    with pytest.raises(InvalidParameterError, match="micro_batch"):
        TrlCompareConfig(prompts_per_step=3, group_size=2, micro_batch=4)
    with pytest.raises(InvalidParameterError, match="loss_agg"):
        TrlCompareConfig(loss_agg="sum")
    cmd = trl_command(TrlCompareConfig(loss_agg="token_mean", scale_adv_by_std=False, clip_high=0.28), "py", "m", "p", "o")
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    assert flags["--loss-type"] == "dapo" and flags["--scale-rewards"] == "none" and flags["--epsilon-high"] == "0.28"
    assert flags["--epsilon"] == "0.2" and flags["--group-size"] == "8" and flags["--micro-batch"] == "8"
    check_drafter("ngram@fixed")
    check_drafter("ar")
    with pytest.raises(InvalidParameterError, match="--drafter 'nope'"):
        check_drafter("nope")


def _tandem_json() -> dict:
    history = [{"step": 0, "step_wall_s": 4.0, "reward_mean": 0.25, "completion_tokens_mean": 100.0},
               {"step": 1, "step_wall_s": 2.0, "reward_mean": 0.5, "completion_tokens_mean": 80.0},
               {"step": 2, "step_wall_s": 3.0, "reward_mean": 0.75, "completion_tokens_mean": 90.0}]
    evals = [{"step": 0, "problems": 4, "greedy": 0.25, "greedy_ci95": [0.0456, 0.6994], "greedy_tokens_mean": 50.0},
             {"step": 3, "problems": 4, "greedy": 0.75, "greedy_ci95": [0.3006, 0.9544], "greedy_tokens_mean": 40.0}]
    return {"history": history, "evals": evals}


def _trl_json() -> dict:
    steps = [{"step": 0, "wall_s": 12.0, "reward_mean": 0.5, "completion_tokens_mean": 110.0},
             {"step": 1, "wall_s": 6.0, "reward_mean": 0.25, "completion_tokens_mean": 70.0},
             {"step": 2, "wall_s": 9.0, "reward_mean": 0.5, "completion_tokens_mean": 95.0}]
    return {"steps": steps, "versions": {"trl": "1.16.0"}, "prompt_ids_match": [10, 10],
            "held_out_start": {"rewards": [0.0, 1.0, 0.0, 0.0], "tokens_mean": 51.0},
            "held_out_end": {"rewards": [1.0, 1.0, 0.0, 1.0], "tokens_mean": 45.0}}


def test_comparison_and_table_from_known_inputs():
    tandem, trl = tandem_side(_tandem_json()), trl_side(_trl_json())
    assert trl["held_out_start"] == {"reward": 0.25, "ci95": [0.0456, 0.6994], "problems": 4, "tokens_mean": 51.0}  # Wilson, 1 of 4
    assert trl["held_out_end"]["ci95"] == [0.3006, 0.9544]  # 3 of 4
    c = compare(tandem, trl)
    assert c["step_wall_s"]["tandem"] == {"mean": 3.0, "mean_after_first": 2.5, "total": 9.0}
    assert c["step_wall_s"]["trl"] == {"mean": 9.0, "mean_after_first": 7.5, "total": 27.0}
    assert c["speedup"] == {"mean": 3.0, "mean_after_first": 3.0}
    assert c["curve"][1] == {"step": 1, "tandem_reward": 0.5, "trl_reward": 0.25, "tandem_tokens": 80.0, "trl_tokens": 70.0,
                             "tandem_wall_s": 2.0, "trl_wall_s": 6.0}
    table = markdown({"comparison": c, "settings": {"steps": 3}})
    assert "| tandem | 3.00 | 2.50 | 0.250 [0.046, 0.699] | 0.750 [0.301, 0.954] |" in table
    assert "| trl | 9.00 | 7.50 | 0.250 [0.046, 0.699] | 0.750 [0.301, 0.954] |" in table
    assert "| TRL / tandem | 3.00x | 3.00x | | |" in table
    assert "| 2 | 0.750 | 0.500 | 90.0 | 95.0 | 3.00 | 9.00 |" in table


@pytest.mark.slow
def test_both_sides_end_to_end_on_the_tiny_model(tiny_llama, tmp_path):
    python = trl_venv() / "bin" / "python"
    if not python.exists():
        pytest.skip(f"TRL's venv is not set up at {trl_venv()} (`tandem bench rl-trl` makes it on first use)")
    ensure_trl_venv()  # present: only checks trl and reasoning_gym import
    cfg = TrlCompareConfig(model=tiny_llama, steps=2, prompts_per_step=2, group_size=2, max_tokens=8, micro_batch=2, eval_problems=4,
                           drafter="ngram", trl_python=str(python), lr=1e-4, task="basic_arithmetic,chain_sum",
                           demonstration=False)  # short questions: the tiny model's byte tokens fit its 512 positions
    report = run_rl_trl_bench(cfg, tmp_path)
    assert report["versions"]["trl_side"]["trl"] == "1.16.0" and report["versions"]["trl_side"]["torch"].startswith("2.13.0")
    assert report["prompt_ids_match"] == [8, 8]  # 2 steps x 2 prompts + 4 held-out, tokenized identically on both sides
    assert report["trl_settings"]["generation_batch_size"] == 4 and report["trl_settings"]["gradient_accumulation_steps"] == 2
    assert report["trl_settings"]["gradient_checkpointing"] is False and report["trl_settings"]["bf16"] is False  # as tandem's learner
    assert report["trl_settings"]["beta"] == 0.0 and report["trl_settings"]["shuffle_dataset"] is False
    c = report["comparison"]
    assert [r["step"] for r in c["curve"]] == [0, 1]
    for side in ("tandem", "trl"):
        assert c["held_out"][side]["start"]["problems"] == 4 and c["held_out"][side]["end"]["problems"] == 4
        assert all(0.0 <= row[f"{side}_reward"] <= 1.0 and 1 <= row[f"{side}_tokens"] <= 8 for row in c["curve"])
    assert c["speedup"]["mean"] == pytest.approx(c["step_wall_s"]["trl"]["mean"] / c["step_wall_s"]["tandem"]["mean"])


def test_no_skip_zero_advantage_reaches_tandems_command_and_grpo_config():
    from tandem.bench.peers.trl_peer import tandem_command

    assert "--no-skip-zero-advantage" not in tandem_command(TrlCompareConfig(), "o") and TrlCompareConfig().grpo().skip_zero_advantage
    equal = TrlCompareConfig(skip_zero_advantage=False)
    assert "--no-skip-zero-advantage" in tandem_command(equal, "o") and not equal.grpo().skip_zero_advantage
