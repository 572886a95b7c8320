"""`tandem bench aurora`: Aurora's experiment in replay, and what each flywheel change bought.

Set-up: a *general* static head (recipe eagle-smollm2-general: chat / instruction data only) serves a
stream of specialised traffic (tandem.flywheel.stream.SPECIALISED: code, SQL, math, summarisation,
translation) in blocks, each domain at least twice. Variants, all replayed exactly on the same cached
target traces (tandem.flywheel.replay):

- plain: no drafter; static: the general head, frozen;
- online_scratch: the flywheel from an untrained head (day 0), with every change below;
- an ablation ladder from the general head, each rung adding one change to the one before:
  `online_base` (the replay's former settings: 0.5 trainer steps per request, uniform replay, lr 1e-4,
  anchor 100), `+steps` (`steps` per request: what the trainer's own core affords), `+balance` (replay drawn
  to balance domains), `+detector` (a detected acceptance drop boosts the step rate and warms the lr),
  `+lr` (the learning rate and anchor for a strong starting head chosen by measurement: `lr`, `anchor`),
  `+recent` (a `recent_share` of each batch from the newest traces: today's traffic is learned at once while
  the balanced rest keeps the other domains). The last rung is `online`.

Reported per variant: mean acceptance length and its ratio to static, per domain, per block, per domain
after its first block, recovery after each shift (the issue's measure: requests until the rolling mean is
back to 90 % of the block's final level), modelled tokens/s, trainer steps, detected shifts, and the trainer's
core load: its measured step time over the stream's modelled decode time (<= 1: a trainer on a core of its own
keeps pace with one decode stream on another, so the replayed step rate is one the live flywheel affords).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tandem.bench.machine import machine_info
from tandem.bench.shift import ShiftConfig, calibrate, replay_mode
from tandem.errors import InvalidParameterError
from tandem.flywheel.stream import SPECIALISED, build_stream, prompt_key
from tandem.flywheel.stream_stats import after_first_block, per_block, recovery_within_block, summarize


@dataclass(frozen=True)
class AuroraConfig:
    general_head: str  # an exported head directory (tandem/heads/eagle-smollm2-general or a run's best/)
    requests: int = 3000
    block: int = 300
    domains: tuple[str, ...] = SPECIALISED
    prompts: str = "builtin"
    max_tokens: int = 64
    steps: float = 2.0  # trainer steps per request from rung `+steps` on
    lr: float = 3e-4  # rung `+lr` (and online): the fine-tuning lr from the general head (sweep: docs/BENCHMARKS.md 10)
    anchor: float = 0.0  # rung `+lr`: its anchor (10 cost 2 points from a general head; the shipped head's 100 more)
    recent_share: float = 0.5  # rung `+recent`: share of each batch from the newest traces
    scratch_lr: float = 1e-3
    variants: tuple[str, ...] = ("plain", "static", "online_base", "+steps", "+balance", "+detector", "+lr", "+recent", "online_scratch")
    window: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        object.__setattr__(self, "variants", tuple(self.variants))
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise InvalidParameterError(f"unknown variant(s) {sorted(unknown)}; known: {VARIANTS}")
        if self.requests < 2 * self.block * len(self.domains):
            raise InvalidParameterError(f"every domain must come back: requests >= 2 x block x domains ({2 * self.block * len(self.domains)})")

    def shift_config(self) -> ShiftConfig:
        return ShiftConfig(prompts=self.prompts, requests=self.requests, block=self.block, domains=self.domains, max_tokens=self.max_tokens,
                           static_prompts=0, static_head=self.general_head, top_up=True, window=self.window, seed=self.seed, lr=self.scratch_lr,
                           modes=("static",))


VARIANTS = ("plain", "static", "online_base", "+steps", "+balance", "+detector", "+lr", "+recent", "online_scratch")


def variant_config(name: str, cfg: AuroraConfig) -> tuple[str, ShiftConfig]:
    """(MODES entry, the ShiftConfig it replays under) of one variant; the ladder's rungs add up in order."""
    base = replace(cfg.shift_config(), train_steps_per_request=0.5, sample="uniform", shift_detect=False, finetune_lr=1e-4, anchor=100.0)
    rungs = {"+steps": {"train_steps_per_request": cfg.steps}, "+balance": {"sample": "domains"}, "+detector": {"shift_detect": True},
             "+lr": {"finetune_lr": cfg.lr, "anchor": cfg.anchor}, "+recent": {"recent_share": cfg.recent_share}}
    if name in ("plain", "static"):
        return name, base
    if name == "online_scratch":
        full = base
        for change in rungs.values():
            full = replace(full, **change)
        return "online_scratch", full
    ladder = ["online_base", *rungs]
    chosen = base
    for rung in ladder[1 : ladder.index(name) + 1]:
        chosen = replace(chosen, **rungs[rung])
    return "online", chosen


def recovery_window(cfg: AuroraConfig) -> int:
    """The rolling window of the within-block recovery measure: at most a tenth of a block, so recovering
    within 10 % of the block is measurable at all (a 20-request window on a 10-request block never is)."""
    return max(1, min(cfg.window, cfg.block // 10))


def run_aurora(cfg: AuroraConfig, log=print) -> dict:
    from tandem.flywheel.replay import target_traces, trace_cache_dir
    from tandem.flywheel.setups import scratch_head, serving_copy
    from tandem.llm import load_tokenizer
    from tandem.models.eagle import EagleConfig, load_eagle
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model, tandem_home

    started = time.perf_counter()
    shift = cfg.shift_config()
    model_dir = Path(resolve_model(shift.model))
    target = load_transformer(model_dir)
    target.pack()
    stream, stream_ids, _ = build_stream(shift.stream, load_tokenizer(model_dir))
    taps = EagleConfig.for_target(target.cfg).taps
    cache = trace_cache_dir(Path(tandem_home()), model_dir, cfg.max_tokens, taps)
    traces = target_traces(target, stream_ids, cfg.max_tokens, taps, cache)
    log(f"traces ready: {len(stream_ids)} distinct prompts for {len(stream)} requests ({time.perf_counter() - started:.0f} s)")
    heads = {"static": load_eagle(cfg.general_head, target), "scratch": scratch_head(target, shift.draft_vocab, cfg.seed)}
    costs = calibrate(target, serving_copy(heads["scratch"]), shift.num_draft_tokens)
    results, extras, settings = {}, {}, {}
    for name in cfg.variants:
        mode, vcfg = variant_config(name, cfg)
        begun = time.perf_counter()
        results[name], extras[name] = replay_mode(mode, target, stream, traces, heads, costs, vcfg)
        settings[name] = {"mode": mode, "steps_per_request": vcfg.train_steps_per_request, "sample": vcfg.sample, "recent_share": vcfg.recent_share,
                          "shift_detect": vcfg.shift_detect,
                          "lr": vcfg.lr if mode == "online_scratch" else vcfg.finetune_lr, "anchor": 0.0 if mode == "online_scratch" else vcfg.anchor,
                          "seconds": round(time.perf_counter() - begun, 1)}
        log(f"{name}: mean acceptance {sum(r['acceptance_length'] for r in results[name]) / len(results[name]):.3f} ({settings[name]['seconds']} s)")
    summary = summarize(results, shift)
    for name in cfg.variants:
        summary[name] |= extras[name] | {"settings": settings[name], "per_block": [b["acceptance_length"] for b in per_block(results[name], cfg.block)],
                                         "after_first_block": after_first_block(results[name], cfg.block),
                                         "recovery_within_block": recovery_within_block(results[name], cfg.block, recovery_window(cfg))}
    counts = {}
    for p in stream:
        counts[prompt_key(p)] = counts.get(prompt_key(p), 0) + 1
    return {"config": asdict(cfg), "machine": machine_info(), "seconds": round(time.perf_counter() - started, 1),
            "stream": {"requests": len(stream), "distinct_prompts": len(stream_ids), "repeated_requests": sum(n - 1 for n in counts.values()),
                       "blocks": [b["domain"] for b in per_block(results[cfg.variants[0]], cfg.block)]},
            "costs": {"verify_s": {str(k): v for k, v in costs["verify_s"].items()}, "draft_step_s": costs["draft_step_s"]},
            "summary": summary, "requests": results}


def table(report: dict) -> str:
    """The markdown table of a report: one row per variant."""
    domains = report["config"]["domains"]
    head = "| variant | mean AL | vs static | " + " | ".join(domains) + " | after 1st block (mean over domains) | recovered <= 10 % of block | trainer steps | trainer core load | tok/s (modelled) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in report["summary"].items():
        after = s.get("after_first_block", {})
        rec = s.get("recovery_within_block", [])
        fast = sum(1 for r in rec if r["fraction"] is not None and r["fraction"] <= 0.1)
        lines.append(f"| {name} | {s['mean_acceptance_length']:.3f} | {s['ratio_to_static'] or 0:.3f} | " + " | ".join(f"{s['per_domain'][d]:.3f}" for d in domains)
                     + f" | {sum(after.values()) / max(1, len(after)):.3f} | {fast}/{len(rec)} | {s.get('trainer_steps', '-')} | {s.get('trainer_core_load', '-')}"
                     + f" | {s['mean_tokens_per_s']:.1f} |")
    return "\n".join(lines)
