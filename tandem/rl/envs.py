"""RL environments from reasoning-gym: its generators make the problems, its scorers give the reward.

A `ReasoningEnv` holds one reasoning-gym dataset per task and hands out problems by index:
training problem i of a run comes from generator seed `train_base + i`, held-out problem j from
`held_out_base + j`; the two seed ranges never overlap (`SEED_SPAN` apart), so the sets are disjoint
by the generator's own seeds. They are disjoint by content too: a training problem whose content key
(task + the question's bag of words and numbers, so "3 + 5" and "5 + 3" share one) is a held-out key
is skipped, and the held-out set itself holds no two problems with one key.

The prompt is a one-shot chat: a worked example exchange, then the question with "think step by step,
then give the final answer as <answer>...</answer>" (reasoning-gym's own answer format). `tandem.rl.rewards` scores completions.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError

SEED_SPAN = 1 << 24  # generator seeds of one split: base + index, index < SEED_SPAN
CANDIDATES_PER_SLOT = 4  # training problem slot k of a step tries indices k*4 .. k*4+3 (skipping held-out twins)
INSTRUCTION = ("Think step by step, then give the final answer as <answer>...</answer>, "
               "with only the answer inside the tags.")
# One worked exchange before the question (a one-shot chat): small models follow the answer format from an
# example far more often than from the instruction alone. It belongs to no task's generator.
DEMONSTRATION = (
    "Sam has 3 bags with 4 marbles in each bag. He gives away 5 marbles. How many marbles does Sam have left?",
    "Sam starts with 3 bags of 4 marbles, so he has 3 * 4 = 12 marbles.\n"
    "He gives away 5, so he has 12 - 5 = 7 marbles left.\n<answer>7</answer>",
)

# The default mix, chosen by measurement (docs/BENCHMARKS.md 9.1; SmolLM2-135M-Instruct, greedy, one-shot prompt, 16
# held-out problems each): 1-digit +/- reward 0.25 (median 18 tokens), chain sums 0.06 (15 tokens), GSM-style word
# problems 0.005 (158 tokens, a tenth reach 256): learning is visible on the first two, and the third gives the batch
# its long tail. (Zero-shot, the model never wrote the answer tags: reward 0 everywhere.)
DEFAULT_TASKS: dict[str, dict] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+", "-"),
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    "gsm_symbolic": {},
}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the generator's reference answer (the scorer may accept other forms)
    task: str  # reasoning-gym dataset name
    index: int  # index within its split (training or held-out)
    entry: dict = field(compare=False, repr=False)  # the generator's full entry (metadata for the scorer)


@dataclass(frozen=True)
class EnvConfig:
    tasks: tuple[str, ...] = tuple(DEFAULT_TASKS)  # reasoning-gym dataset names, drawn round-robin
    task_kwargs: dict = field(default_factory=lambda: {k: dict(v) for k, v in DEFAULT_TASKS.items()})  # per task: config overrides
    instruction: str = INSTRUCTION
    demonstration: bool = True  # a one-shot worked example before the question

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise InvalidParameterError(f"tasks must be distinct and non-empty, got {self.tasks}")
        unknown = set(self.task_kwargs) - set(self.tasks)
        if unknown:
            raise InvalidParameterError(f"task_kwargs for tasks not in the mix: {sorted(unknown)}")

    @classmethod
    def for_tasks(cls, tasks: list[str] | tuple[str, ...]) -> "EnvConfig":
        """The named tasks; those in the default mix keep its measured settings, others the library's defaults."""
        return cls(tuple(tasks), {t: dict(DEFAULT_TASKS[t]) for t in tasks if t in DEFAULT_TASKS})

    def as_dict(self) -> dict:
        return {"tasks": list(self.tasks), "task_kwargs": {t: {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}
                                                           for t, kw in sorted(self.task_kwargs.items())},
                "instruction": self.instruction, "demonstration": self.demonstration}


def content_key(task: str, question: str) -> tuple:
    """The question's bag of words, numbers and symbols: reordered twins ("3 + 5" / "5 + 3") share a key."""
    return (task, tuple(sorted(Counter(re.findall(r"\w+|[^\w\s]", question.lower())).items())))


def _dataset(task: str, kwargs: dict, seed: int):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=SEED_SPAN, **kwargs)
    except ValueError as e:
        raise InvalidParameterError(f"reasoning-gym task {task!r}: {e}") from e
    except (TypeError, AssertionError) as e:
        raise InvalidParameterError(f"reasoning-gym task {task!r} rejects its settings {kwargs}: {e}") from e


class ReasoningEnv:
    """Problems of a task mix, split into training and held-out by generator seed and by content."""

    def __init__(self, cfg: EnvConfig = EnvConfig(), seed: int = 0, held_out_size: int = 128):
        if seed < 0 or held_out_size < 0:
            raise InvalidParameterError(f"need seed >= 0 and held_out_size >= 0, got {seed}, {held_out_size}")
        self.cfg, self.seed = cfg, seed
        train_base, held_base = 2 * seed * SEED_SPAN, (2 * seed + 1) * SEED_SPAN
        self._train = {t: _dataset(t, cfg.task_kwargs.get(t, {}), train_base) for t in cfg.tasks}
        self._held = {t: _dataset(t, cfg.task_kwargs.get(t, {}), held_base) for t in cfg.tasks}
        self.held_out = self._held_out(held_out_size)
        self._held_keys = {content_key(p.task, p.question) for p in self.held_out}

    def _problem(self, datasets: dict, i: int) -> Problem:
        task = self.cfg.tasks[i % len(self.cfg.tasks)]
        entry = datasets[task][i // len(self.cfg.tasks)]
        return Problem(entry["question"], str(entry["answer"]), task, i, entry)

    def _held_out(self, n: int) -> list[Problem]:
        out, keys, i = [], set(), 0
        while len(out) < n:
            if i > 20 * n + 100:
                raise InvalidParameterError(f"the task mix {self.cfg.tasks} has fewer than {n} distinct problems")
            p = self._problem(self._held, i)
            i += 1
            key = content_key(p.task, p.question)
            if key not in keys:
                keys.add(key)
                out.append(p)
        return out

    def training_problem(self, i: int) -> Problem | None:
        """Training problem i, or None where its content is held out (the caller moves on to i + 1)."""
        if not 0 <= i < SEED_SPAN * len(self.cfg.tasks):
            raise InvalidParameterError(f"training index {i} out of range")
        p = self._problem(self._train, i)
        return None if content_key(p.task, p.question) in self._held_keys else p

    def training_problems(self, start: int, n: int) -> tuple[list[Problem], int]:
        """n training problems from index `start` on (held-out twins skipped) and the next unused index."""
        out, i = [], start
        while len(out) < n:
            p = self.training_problem(i)
            i += 1
            if p is not None:
                out.append(p)
            elif i - start > 100 * n + 100:
                raise InvalidParameterError("almost every training problem is held out: the task mix is too small")
        return out, i

    def step_problems(self, step: int, prompts_per_step: int) -> list[Problem]:
        """A GRPO step's problems: slot k takes the first of its CANDIDATES_PER_SLOT indices that is not held out
        (stateless, so a resumed or async run, and an exported one, draws the same problems)."""
        out = []
        for k in range(step * prompts_per_step, (step + 1) * prompts_per_step):
            candidates = (self.training_problem(k * CANDIDATES_PER_SLOT + c) for c in range(CANDIDATES_PER_SLOT))
            problem = next((p for p in candidates if p is not None), None)
            if problem is None:
                raise InvalidParameterError("the task mix's training problems are all held-out twins: raise its size")
            out.append(problem)
        return out

    def messages(self, problem: Problem) -> list[dict]:
        shot = []
        if self.cfg.demonstration:
            shot = [{"role": "user", "content": f"{DEMONSTRATION[0]}\n\n{self.cfg.instruction}"}, {"role": "assistant", "content": DEMONSTRATION[1]}]
        return shot + [{"role": "user", "content": f"{problem.question}\n\n{self.cfg.instruction}"}]

    def render(self, problem: Problem, tokenizer) -> list[int]:
        """The problem as one chat user turn (token ids for the engine)."""
        ids = tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def score(self, task: str, answer: str | None, entry: dict) -> float:
        """reasoning-gym's own scorer for `task` on an extracted answer (None = no answer given)."""
        return float(self._train[task].score_answer(answer, entry))

    def exact(self, problem: Problem, text: str) -> bool:
        """Exact accuracy: the answer in the completion's last <answer>...</answer> gets the task scorer's full score,
        1.0: equal to the reference after that scorer's own normalisation (basic_arithmetic: the same string;
        chain_sum: the same decimal, sign, leading zeros and commas tolerated; gsm_symbolic: its first number equal),
        never the partial credit those scorers give otherwise ("17" against "7": 0.5)."""
        from reasoning_gym.utils import extract_answer

        return self.score(problem.task, extract_answer(text), problem.entry) == 1.0


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a mean of n rewards in [0, 1] (successes = their sum)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))
