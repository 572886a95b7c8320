"""Verifiable tasks generated locally: arithmetic and templated word problems with exact-match reward.

Problems come from a seeded `random.Random`, so a (seed, index) pair always gives the same problem and a
held-out set never needs to be stored. The reward parses the model's answer robustly: an explicit
"answer is X" / "#### X" / "\\boxed{X}" / "= X" wins, otherwise the last number in the text; thousands
separators, a sign and a trailing ".0" are understood.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tandem.errors import InvalidParameterError

KINDS = ("add", "sub", "mul", "word")
INSTRUCTION = "Answer with just the number."

_NAMES = ("Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Eva", "Ravi")
_ITEMS = ("apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "cards")
_WORD_TEMPLATES = (
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} {item} and gave away {b}. How many {item} are left?", lambda a, b: a - b),
    ("There are {a} boxes with {b} {item} in each box. How many {item} are there in total?", lambda a, b: a * b),
    ("{name} buys {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} buy?", lambda a, b: a + b),
)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    kind: str


@dataclass(frozen=True)
class TaskConfig:
    kinds: tuple[str, ...] = ("add", "sub", "word")  # problem kinds, drawn uniformly
    max_value: int = 20  # operands are drawn from 1..max_value (products: 1..12)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise InvalidParameterError(f"task kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if self.max_value < 2:
            raise InvalidParameterError(f"max_value must be >= 2, got {self.max_value}")


def make_problem(rng: random.Random, cfg: TaskConfig) -> Problem:
    kind = rng.choice(cfg.kinds)
    a, b = rng.randint(1, cfg.max_value), rng.randint(1, cfg.max_value)
    if kind == "add":
        return Problem(f"What is {a} + {b}?", a + b, kind)
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return Problem(f"What is {a} - {b}?", a - b, kind)
    if kind == "mul":
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        return Problem(f"What is {a} * {b}?", a * b, kind)
    template, solve = rng.choice(_WORD_TEMPLATES)
    a, b = max(a, b), min(a, b)  # keeps "gave away" non-negative
    if solve(3, 2) == 6:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    return Problem(template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b), solve(a, b), kind)


def problems(n: int, seed: int, cfg: TaskConfig = TaskConfig(), exclude: set[str] | None = None) -> list[Problem]:
    """n problems from `seed`; questions in `exclude` (a held-out set) are skipped."""
    rng, out, tries = random.Random(seed), [], 0
    while len(out) < n:
        problem = make_problem(rng, cfg)
        tries += 1
        if exclude and problem.question in exclude:
            if tries > 100 * n:
                raise InvalidParameterError("cannot draw enough problems outside the held-out set: raise max_value")
            continue
        out.append(problem)
    return out


def prompt_text(problem: Problem) -> str:
    return f"{problem.question} {INSTRUCTION}"


def render_prompt(problem: Problem, tokenizer) -> list[int]:
    """The problem as one chat user turn (token ids for the engine)."""
    messages = [{"role": "user", "content": prompt_text(problem)}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_EXPLICIT = (
    re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"),
    re.compile(r"####\s*(" + _NUMBER + ")"),
    re.compile(r"answer\s*(?:is|:)?\s*[:=]?\s*\$?(" + _NUMBER + ")", re.IGNORECASE),
    re.compile(r"=\s*(" + _NUMBER + r")\s*\.?\s*$"),
)


def parse_answer(text: str) -> int | None:
    """The integer the text answers with, or None (no number, or a non-integer)."""
    for pattern in _EXPLICIT:
        found = pattern.findall(text)
        if found:
            return _to_int(found[-1])
    numbers = re.findall(_NUMBER, text)
    return _to_int(numbers[-1]) if numbers else None


def _to_int(token: str) -> int | None:
    token = token.replace(",", "").rstrip(".")
    try:
        value = float(token)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def reward(text: str, problem: Problem) -> float:
    """Exact match of the parsed answer: 1.0 or 0.0."""
    return 1.0 if parse_answer(text) == problem.answer else 0.0
