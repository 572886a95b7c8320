"""Rewards: a completion's text and its problem -> a float in [0, 1].

`reasoning_gym_reward` is the default: the answer inside the last <answer>...</answer> pair
(reasoning-gym's own `extract_answer`), scored by the task's own `score_answer` (no parser of ours).
`math_verify_reward` scores free-form math (fractions, expressions, LaTeX) by equivalence with the
reference via `math-verify`. `load_reward("module:function")` loads a user's own with the same signature:
`fn(text: str, problem: Problem, env: ReasoningEnv) -> float`.
"""
from __future__ import annotations

import importlib

from tandem.errors import InvalidParameterError


def reasoning_gym_reward(text: str, problem, env) -> float:
    from reasoning_gym.utils import extract_answer

    return env.score(problem.task, extract_answer(text), problem.entry)


def math_verify_reward(text: str, problem, env) -> float:
    """1.0 when the tagged answer is mathematically equal to the reference (math-verify), else 0.0."""
    from math_verify import parse, verify
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    if answer is None:
        return 0.0
    gold, guess = parse(f"${problem.answer}$"), parse(f"${answer}$")
    return 1.0 if gold and guess and verify(gold, guess) else 0.0


BUILTIN = {"reasoning_gym": reasoning_gym_reward, "math_verify": math_verify_reward}
LABELS = {"reasoning_gym": "reward (reasoning-gym score, partial credit)", "math_verify": "reward (math-verify, 0 or 1)"}


def reward_label(spec: str) -> str:
    """What a plot calls the reward `spec` names."""
    return LABELS.get(spec, f"reward ({spec})")


def load_reward(spec: str):
    """A built-in name, or "module:function" importable from the current environment."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidParameterError(f"--reward takes {sorted(BUILTIN)} or module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise InvalidParameterError(f"cannot load the reward {spec!r}: {e}") from e
    if not callable(fn):
        raise InvalidParameterError(f"the reward {spec!r} is not callable")
    return fn
