"""reasoning-gym environments: disjoint held-out split (seeds and content), prompts, the library's scorers."""
import pytest

from tandem.errors import InvalidParameterError
from tandem.rl.envs import SEED_SPAN, EnvConfig, Problem, ReasoningEnv, content_key, wilson_interval
from tandem.rl.rewards import load_reward, math_verify_reward, reasoning_gym_reward


def test_content_key_matches_reordered_twins_only():
    assert content_key("t", "What is 3 + 5?") == content_key("t", "What is 5 + 3?")
    assert content_key("t", "What is 3 + 5?") != content_key("t", "What is 3 - 5?")
    assert content_key("t", "What is 3 + 5?") != content_key("u", "What is 3 + 5?")


def test_held_out_is_disjoint_from_training_by_seed_and_content():
    env = ReasoningEnv(EnvConfig(), seed=3, held_out_size=64)
    for task in env.cfg.tasks:  # generator seeds: training [6 * SPAN, 7 * SPAN), held-out [7 * SPAN, 8 * SPAN)
        assert env._train[task].seed == 6 * SEED_SPAN and env._held[task].seed == 7 * SEED_SPAN
    held = {content_key(p.task, p.question) for p in env.held_out}
    assert len(held) == len(env.held_out) == 64  # no duplicates inside the held-out set
    training = [env.training_problem(i) for i in range(3000)]
    assert any(p is None for p in training)  # small generators do produce held-out twins, and they are skipped
    assert not held & {content_key(p.task, p.question) for p in training if p is not None}
    again = ReasoningEnv(EnvConfig(), seed=3, held_out_size=64)
    assert [p.question for p in again.held_out] == [p.question for p in env.held_out]  # a pure function of the seed


def test_training_problems_skip_held_out_and_round_robin_tasks():
    env = ReasoningEnv(EnvConfig(), seed=0, held_out_size=16)
    out, nxt = env.training_problems(0, 10)
    assert len(out) == 10 and nxt >= 10
    assert {p.task for p in out} == set(env.cfg.tasks)


def test_unknown_task_and_bad_settings_are_clear_errors():
    with pytest.raises(InvalidParameterError, match="no_such_task"):
        ReasoningEnv(EnvConfig.for_tasks(["no_such_task"]), held_out_size=1)
    with pytest.raises(InvalidParameterError, match="rejects its settings"):
        ReasoningEnv(EnvConfig(("chain_sum",), {"chain_sum": {"min_terms": 5, "max_terms": 2}}), held_out_size=1)
    with pytest.raises(InvalidParameterError, match="not in the mix"):
        EnvConfig(("chain_sum",), {"basic_arithmetic": {}})


def test_prompt_is_a_one_shot_chat_asking_for_a_tagged_answer(tiny_llama):
    from tandem.llm import load_tokenizer
    from tandem.rl.envs import DEMONSTRATION

    tok = load_tokenizer(tiny_llama)
    env = ReasoningEnv(EnvConfig(), held_out_size=1)
    p = env.held_out[0]
    question = {"role": "user", "content": f"{p.question}\n\n{env.cfg.instruction}"}
    assert env.messages(p) == [{"role": "user", "content": f"{DEMONSTRATION[0]}\n\n{env.cfg.instruction}"},
                               {"role": "assistant", "content": DEMONSTRATION[1]}, question]
    assert "<answer>7</answer>" in DEMONSTRATION[1] and "<answer>" in env.cfg.instruction
    ids = env.render(p, tok)
    assert ids == list(tok.apply_chat_template(env.messages(p), add_generation_prompt=True, tokenize=True, return_dict=False))
    zero_shot = ReasoningEnv(EnvConfig(demonstration=False), held_out_size=1)
    assert zero_shot.messages(p) == [question]


def test_reasoning_gym_reward_uses_the_library_scorer():
    env = ReasoningEnv(EnvConfig.for_tasks(["basic_arithmetic"]), held_out_size=4)
    p = env.held_out[0]
    assert reasoning_gym_reward(f"Let me think. ... so <answer>{p.answer}</answer>", p, env) == 1.0
    assert reasoning_gym_reward(f"The answer is {p.answer}.", p, env) == 0.0  # untagged: the library finds no answer
    assert reasoning_gym_reward(f"<answer>{int(p.answer) + 1}</answer>", p, env) == 0.0
    assert reasoning_gym_reward(f"<answer>0</answer> then <answer>{p.answer}</answer>", p, env) == 1.0  # the last pair counts


def test_exact_accuracy_is_the_scorers_full_score_never_partial_credit():
    """reasoning-gym gives "17" against "7" half the reward (the reference is a substring); exact accuracy counts only
    the scorer's 1.0, after its own normalisation (chain_sum: "+07" is the decimal 7)."""
    env = ReasoningEnv(EnvConfig.for_tasks(["basic_arithmetic", "chain_sum"]), held_out_size=2)
    seven = Problem("What is 3 + 4?", "7", "basic_arithmetic", 0, {"answer": "7"})
    assert reasoning_gym_reward("<answer>17</answer>", seven, env) == 0.5 and env.exact(seven, "<answer>17</answer>") is False
    assert reasoning_gym_reward("<answer>7</answer>", seven, env) == 1.0 and env.exact(seven, "<answer>7</answer>") is True
    assert env.exact(seven, "7") is False  # untagged: no answer
    chain = Problem("3 + 4 =", "7", "chain_sum", 0, {"answer": "7"})
    assert env.exact(chain, "<answer>+07</answer>") is True and env.exact(chain, "<answer>17</answer>") is False


def test_math_verify_reward_accepts_equivalent_forms():
    p = Problem("Simplify 2/4", "1/2", "fraction_simplification", 0, {})
    assert math_verify_reward(r"<answer>\frac{1}{2}</answer>", p, None) == 1.0
    assert math_verify_reward("<answer>0.5</answer>", p, None) == 1.0
    assert math_verify_reward("<answer>2/3</answer>", p, None) == 0.0
    assert math_verify_reward("1/2", p, None) == 0.0


def test_load_reward():
    assert load_reward("reasoning_gym") is reasoning_gym_reward
    assert load_reward("tandem.rl.rewards:math_verify_reward") is math_verify_reward
    for bad in ("nope", "tandem.rl.rewards:missing", "no_module_xyz:f"):
        with pytest.raises(InvalidParameterError):
            load_reward(bad)


def test_wilson_interval_known_values():
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(0, 128)[0] == 0.0 and wilson_interval(0, 128)[1] == pytest.approx(0.0291, abs=1e-4)
