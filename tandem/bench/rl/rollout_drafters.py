"""RL rollouts per drafter on chain-of-thought math: acceptance length and rollout wall time (issue 37, item 4).

`run(RolloutDrafterBench(...))` decodes `group_size` samples of each of `prompts` reasoning-gym problems (chat
templated, "think step by step") through `tandem.rl.rollout.RolloutEngine`, once per drafter over one loaded
target, and repeats the same prompts for `rounds` rounds on the same engines (new seeds): round 2 is a later RL
step on the same problems, where the suffix drafter also has round 1's rollouts. Each row: drafter, round,
acceptance length (RolloutBatch.acceptance_length), rollout wall time, output tokens, drafting time per
request-step. Needs `reasoning-gym` (pip install reasoning-gym==0.1.25).

    python -m tandem.bench.rl.rollout_drafters --prompts 2 --group-size 8 --max-tokens 256 --temperature 1.0
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from tandem.bench.machine import machine_info
from tandem.config import EngineConfig, SamplingParams
from tandem.errors import InvalidParameterError

INSTRUCTION = "Think step by step, then give the final answer on the last line as 'Answer: <number>'."


@dataclass(frozen=True)
class RolloutDrafterBench:
    model: str = "smollm2-135m"
    task: str = "gsm_symbolic"  # any reasoning-gym dataset with a "question" field
    prompts: int = 2
    group_size: int = 8
    max_tokens: int = 256
    temperature: float = 1.0
    drafters: tuple[str, ...] = ("ar", "ngram", "self_draft", "suffix", "suffix_self")
    num_draft_tokens: int = 4
    rounds: int = 2
    seed: int = 0
    adaptive_k: bool = False  # True: the speculation controller picks k per step (as `tandem rl` does)

    def __post_init__(self) -> None:
        if min(self.prompts, self.group_size, self.max_tokens, self.rounds, self.num_draft_tokens) < 1:
            raise InvalidParameterError("prompts, group_size, max_tokens, rounds and num_draft_tokens must be >= 1")


def task_prompts(tokenizer, task: str, n: int, seed: int) -> list[list[int]]:
    import reasoning_gym

    data = reasoning_gym.create_dataset(task, size=n, seed=seed)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": f"{item['question']}\n{INSTRUCTION}"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)) for item in data]


def run(cfg: RolloutDrafterBench) -> list[dict]:
    from tandem.drafters import build_drafter
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model
    from tandem.rl.rollout import RolloutEngine

    path = resolve_model(cfg.model)
    target = load_transformer(path)
    target.pack()
    prompts = task_prompts(load_tokenizer(path), cfg.task, cfg.prompts, cfg.seed)
    batch = cfg.prompts * cfg.group_size
    max_len = max(map(len, prompts)) + cfg.max_tokens + 8
    rows = []
    for name in cfg.drafters:
        drafter = None if name == "ar" else build_drafter(name, target=target, num_draft_tokens=cfg.num_draft_tokens, max_batch=batch, max_len=max_len)
        policy = None
        if drafter is not None and cfg.adaptive_k:
            from tandem.engine.control import SpeculationController

            policy = SpeculationController.for_engine(target, drafter, model_name=cfg.model, max_k=cfg.num_draft_tokens)
        engine = RolloutEngine(target, drafter, EngineConfig(max_batch_size=batch, max_model_len=max_len), draft_policy=policy, name=name)
        for round_ in range(cfg.rounds):
            params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed + 7919 * round_)
            out = engine.generate_rollouts(prompts, cfg.group_size, params)
            steps = sum(r.metrics["steps"] for r in out.rollouts)
            draft_s = sum(r.metrics["draft_time_s"] for r in out.rollouts)
            row = {"drafter": name, "round": round_ + 1, "acceptance_length": round(out.acceptance_length(), 3),
                   "wall_s": round(out.wall_s, 2), "output_tokens": sum(len(r.completion_ids) for r in out.rollouts),
                   "mean_completion": round(sum(len(r.completion_ids) for r in out.rollouts) / len(out.rollouts), 1),
                   "draft_us_per_request_step": round(1e6 * draft_s / steps, 1) if steps else 0.0}
            if hasattr(drafter, "chosen"):
                row["chosen"] = dict(drafter.chosen)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = RolloutDrafterBench()
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--task", default=defaults.task)
    p.add_argument("--prompts", type=int, default=defaults.prompts)
    p.add_argument("--group-size", type=int, default=defaults.group_size)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument("--drafters", default=",".join(defaults.drafters))
    p.add_argument("--num-draft-tokens", type=int, default=defaults.num_draft_tokens)
    p.add_argument("--rounds", type=int, default=defaults.rounds)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--adaptive-k", action="store_true")
    a = p.parse_args(argv)
    cfg = RolloutDrafterBench(a.model, a.task, a.prompts, a.group_size, a.max_tokens, a.temperature, tuple(a.drafters.split(",")),
                              a.num_draft_tokens, a.rounds, a.seed, a.adaptive_k)
    print(json.dumps({"config": asdict(cfg), "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}), flush=True)
    return run(cfg)


if __name__ == "__main__":
    main()
