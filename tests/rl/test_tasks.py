import pytest

from tandem.errors import InvalidParameterError
from tandem.models.tiny import byte_tokenizer
from tandem.rl.tasks import Problem, TaskConfig, parse_answer, problems, render_prompt, reward


@pytest.mark.parametrize("text, expected", [
    ("12", 12), ("The answer is 12.", 12), ("3 + 9 = 12", 12), ("So 3 + 9 = 12.", 12), ("\\boxed{1,234}", 1234),
    ("#### -7", -7), ("Answer: 40", 40), ("I think 5 apples plus 7 apples makes 12 apples", 12), ("12.0", 12),
    ("The answer is 12. Because 4 + 8 = 12 and 3", 12), ("no number here", None), ("2.5", None), ("", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_reward_is_exact_match():
    p = Problem("What is 5 + 7?", 12, "add")
    assert reward("5 + 7 = 12", p) == 1.0 and reward("13", p) == 0.0 and reward("", p) == 0.0


def test_problems_are_seeded_correct_and_respect_the_held_out_set():
    cfg = TaskConfig(kinds=("add", "sub", "mul", "word"), max_value=20)
    a, b = problems(50, seed=3, cfg=cfg), problems(50, seed=3, cfg=cfg)
    assert a == b and {p.kind for p in a} == {"add", "sub", "mul", "word"}
    for p in a:
        if p.kind in ("add", "sub", "mul"):
            x, op, y = p.question.removeprefix("What is ").removesuffix("?").split()
            assert p.answer == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert p.answer >= 0
    held = {p.question for p in a[:10]}
    assert not held & {p.question for p in problems(50, seed=4, cfg=cfg, exclude=held)}
    with pytest.raises(InvalidParameterError):
        TaskConfig(kinds=("div",))


def test_render_prompt_is_one_chat_turn():
    tok = byte_tokenizer()
    ids = render_prompt(Problem("What is 1 + 1?", 2, "add"), tok)
    assert "What is 1 + 1? Answer with just the number." in tok.decode(ids)
