"""`tandem bench control`: the speculation controller against every fixed draft shape, per setting, interleaved.

A setting is (drafter, batch size B). Its runners share one loaded target and one drafter: plain decoding, each fixed
shape the drafter offers (`drafter.shapes()`: every row asks for that budget every step), and the controller, each
an engine of B slots. Each round runs the same queue of waves x B chat-templated prompts (domains round-robin, so a
batch mixes them; greedy, ignore_eos, the same max_tokens) through every runner, in an order rotated each round, so
that the ratios of a round come from the same minutes. With waves > 1 a finished request's slot is refilled from the
queue, as in a server; waves = 1 is one synchronized batch, whose rows all finish at the same step under plain
decoding but not under speculation (rows that accept more finish first and leave a tail of fewer rows). Reported per
setting: each runner's tokens/s (median over rounds), the best fixed shape, and the controller's ratio to plain and
to that best shape, per round and median (the spread). The controller persists across rounds and settings, as in a
server; the fixed runners have nothing to learn.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

from tandem.bench.speculation.batch import interleave_domains
from tandem.bench.machine import machine_info
from tandem.config import SamplingParams
from tandem.data.prompts import load_prompts, render_chat
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class ControlBenchConfig:
    model: str = "smollm2-135m"
    weights: str = "fp32"  # the target's weights (int8 / int4 on the integer kernels)
    drafters: tuple[str, ...] = ("eagle_ngram", "ngram")
    drafter_model: str | None = None  # draft_model*: the smaller model that drafts
    batch_sizes: tuple[int, ...] = (1, 4, 16, 60)
    num_draft_tokens: int = 4
    budgets: tuple[int, ...] = ()  # fixed shapes to sweep, by budget; () = every shape the drafter offers
    max_tokens: int = 64
    rounds: int = 3
    waves: int = 4  # prompts per round = waves x batch, through batch slots
    prompts: str = "builtin"  # "builtin" (its test split) or a JSONL file of {"domain", "prompt"} lines
    max_model_len: int = 1024

    def __post_init__(self) -> None:
        if not self.drafters or not self.batch_sizes or min(self.batch_sizes) < 1 or self.rounds < 1 or self.waves < 1 or self.max_tokens < 2:
            raise InvalidParameterError("bench control needs drafters, batch sizes >= 1, rounds >= 1 and max_tokens >= 2")


class FixedBudget:
    """A draft policy that asks every row for the same budget every step (one fixed shape)."""

    def __init__(self, budget: int):
        self.budget = budget

    def plan(self, requests) -> list[int]:
        return [self.budget] * len(requests)

    def observe(self, *args) -> None:
        pass

    def release(self, request) -> None:
        pass


def run_control_bench(config: ControlBenchConfig, progress=print) -> dict:
    from tandem.engine.control import SpeculationController
    from tandem.llm import LLM

    base = LLM(model=config.model, max_batch_size=max(config.batch_sizes), max_model_len=config.max_model_len, weights=config.weights)
    prompts = _prompts(config, base.tokenizer)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)
    settings = []
    for name in config.drafters:
        drafter = base.with_drafter(name, config.num_draft_tokens, drafter_model=config.drafter_model).engine.drafter
        shapes = [s for s in drafter.shapes() if not config.budgets or s.budget in config.budgets]
        controller = SpeculationController.for_engine(base.target, drafter, model_name=config.model, max_k=config.num_draft_tokens)
        for batch in config.batch_sizes:
            slots = replace(base.config, max_batch_size=batch)
            runners = {"plain": Engine(base.target, slots)}
            runners |= {s.name: Engine(base.target, slots, drafter=drafter, draft_policy=FixedBudget(s.budget)) for s in shapes}
            runners["controller"] = Engine(base.target, slots, drafter=drafter, draft_policy=controller)
            settings.append(_run_setting(name, batch, runners, prompts, params, config, progress))
            settings[-1]["controller_metrics"] = _brief(controller.metrics())
    return {"config": asdict(config), "machine": machine_info(), "settings": settings}


def _prompts(config: ControlBenchConfig, tokenizer) -> list[list[int]]:
    found = load_prompts(config.prompts, split="test" if config.prompts == "builtin" else "all")
    ids = render_chat(interleave_domains(found), tokenizer)
    ids = [p for p in ids if len(p) + config.max_tokens + config.num_draft_tokens * 3 < config.max_model_len]
    if len(ids) < max(config.batch_sizes):
        raise InvalidParameterError(f"{len(ids)} prompts fit max_model_len {config.max_model_len}; the largest batch needs {max(config.batch_sizes)}")
    # a round takes waves x batch prompts, wrapping around when there are fewer: repeats are fine (every runner gets them)
    return ids


def _run_setting(drafter: str, batch: int, runners: dict[str, Engine], prompts: list[list[int]], params: SamplingParams,
                 config: ControlBenchConfig, progress) -> dict:
    rates: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    per_round = config.waves * batch
    for r in range(config.rounds):
        queue = [prompts[(r * per_round + i) % len(prompts)] for i in range(per_round)]
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            rates[name].append(_tokens_per_second(runners[name], queue, params))
        progress(f"[bench control] {drafter} batch {batch} round {r + 1}/{config.rounds}: "
                 + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names))
    return summarize(drafter, batch, rates)


def _tokens_per_second(engine: Engine, wave: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    done = engine.run(wave, [params] * len(wave))
    return sum(len(r.output_ids) for r in done) / (time.perf_counter() - start)


def summarize(drafter: str, batch: int, rates: dict[str, list[float]]) -> dict:
    """Per runner the median tokens/s; the best fixed shape by median; the controller's ratios per round (each round's
    runners ran in the same minutes) and their median."""
    fixed = [n for n in rates if n not in ("plain", "controller")]
    best = max(fixed, key=lambda n: statistics.median(rates[n]))
    rounds = range(len(rates["plain"]))
    vs_plain = [rates["controller"][i] / rates["plain"][i] for i in rounds]
    vs_best = [rates["controller"][i] / rates[best][i] for i in rounds]
    return {"drafter": drafter, "batch": batch, "tok_s": {n: round(statistics.median(v), 2) for n, v in rates.items()},
            "best_fixed": best, "controller_vs_plain": round(statistics.median(vs_plain), 3),
            "controller_vs_best_fixed": round(statistics.median(vs_best), 3),
            "controller_vs_plain_rounds": [round(x, 3) for x in vs_plain], "controller_vs_best_fixed_rounds": [round(x, 3) for x in vs_best]}


def _brief(metrics: dict) -> dict:
    keys = ("steps", "speculative_steps", "probes", "switches", "speculating", "ragged", "shape_rows", "shape_emitted",
            "predicted_speedup_mean", "realised_speedup_mean", "realised_speedup_overall")
    return {k: metrics[k] for k in keys}


def format_table(report: dict) -> str:
    lines = ["| drafter | batch | plain tok/s | best fixed shape | its tok/s | controller tok/s | vs plain | vs best fixed (rounds) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in report["settings"]:
        t = s["tok_s"]
        lines.append(f"| {s['drafter']} | {s['batch']} | {t['plain']} | {s['best_fixed']} | {t[s['best_fixed']]} | {t['controller']} | "
                     f"{s['controller_vs_plain']}x | {s['controller_vs_best_fixed']}x ({', '.join(map(str, s['controller_vs_best_fixed_rounds']))}) |")
    return "\n".join(lines)


def add_bench_control_command(bench) -> None:
    d = ControlBenchConfig()
    p = bench.add_parser("control", help="the speculation controller vs every fixed draft shape and plain, per drafter and batch, interleaved")
    p.add_argument("--model", default=d.model)
    p.add_argument("--weights", default=d.weights, choices=("fp32", "bf16", "int8", "int4"), help="the target's weights")
    p.add_argument("--drafters", default=",".join(d.drafters))
    p.add_argument("--drafter-model", default=None, help="draft_model*: the smaller model that drafts (e.g. qwen2.5-coder-0.5b)")
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)))
    p.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens)
    p.add_argument("--budgets", default="", help="fixed shapes to sweep, by budget (default: every shape the drafter offers)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--waves", type=int, default=d.waves, help="prompts per round = waves x batch through batch slots (1: one synchronized batch)")
    p.add_argument("--prompts", default=d.prompts, help="builtin, or a JSONL file of {domain, prompt} lines")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_bench_control)


def _bench_control(args) -> int:
    import json
    from pathlib import Path

    import torch

    torch.set_num_threads(args.threads)
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    config = ControlBenchConfig(model=args.model, weights=args.weights, drafter_model=args.drafter_model, drafters=tuple(x for x in args.drafters.split(",") if x), batch_sizes=ints(args.batch_sizes),
                                num_draft_tokens=args.num_draft_tokens, budgets=ints(args.budgets), max_tokens=args.max_tokens,
                                rounds=args.rounds, waves=args.waves, prompts=args.prompts)
    report = run_control_bench(config)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return 0
