"""`tandem bench aurora`: Aurora's experiment in replay, and what each flywheel change bought.

Set-up: a *general* static head (recipe eagle-smollm2-general: chat / instruction data only) serves a
stream of specialised traffic (tandem.flywheel.stream.SPECIALISED: code, SQL, math, summarisation,
translation) in blocks, each domain at least twice. Variants, all replayed exactly on the same cached
target traces (tandem.flywheel.replay):

- plain: no drafter; static: the general head, frozen;
- online_scratch: the flywheel from an untrained head (day 0), with every change below;
- an ablation ladder from the general head, each rung adding one change to the one before:
  `online_base` (the replay's former settings: 0.5 trainer steps per request, uniform replay, lr 1e-4,
  anchor 100), `+steps` (`steps` per request, by default what the trainer's own core affords, measured step by
  step against the request's modelled serving time: tandem.flywheel.pace.CoreBudget), `+balance` (replay drawn
  to balance domains), `+detector` (a detected acceptance drop warms the lr: 2x, decaying over 64 requests; the step rate
  stays at `steps`, since a trainer that already takes every step its core affords has none to add; a
  step-rate boost took the trainer to 1.5 cores in the first 3,000-request replay),
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

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tandem.bench.children import log_tail
from tandem.bench.machine import machine_info, source_sha256
from tandem.bench.flywheel.shift import ShiftConfig, calibrate, replay_mode
from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.setups import FlywheelSetup
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
    steps: float | None = FlywheelSetup.steps_per_request  # trainer steps per request from rung `+steps` on; None = what one trainer core affords
    lr: float = FlywheelSetup.finetune_lr  # rung `+lr` (and online): the fine-tuning lr from the general head (sweep: docs/BENCHMARKS.md 10)
    anchor: float = FlywheelSetup.anchor  # rung `+lr`: its anchor (10 cost 2 points from a general head; the shipped head's 100 more)
    recent_share: float = FlywheelSetup.recent_share  # rung `+recent`: share of each batch from the newest traces
    scratch_lr: float = FlywheelSetup.lr
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
    """(MODES entry, the ShiftConfig it replays under) of one variant; the ladder's rungs add up in order, and
    the last (`+recent`) is the flywheel's defaults (tandem.flywheel.setups.DEFAULTS) unless cfg overrides them."""
    base = replace(cfg.shift_config(), train_steps_per_request=0.5, sample="uniform", shift_detect=False, finetune_lr=1e-4, anchor=100.0, recent_share=0.0)
    rungs = {"+steps": {"train_steps_per_request": cfg.steps}, "+balance": {"sample": "domains"}, "+detector": {"shift_detect": True, "boost_steps_per_request": 0.0},
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


def run_aurora(cfg: AuroraConfig, log=print, out: str | Path | None = None, jobs: int = 1) -> dict:
    """Replay every variant of `cfg` on the stream's cached target traces. With `out`, each finished variant is
    kept in OUT/variants/NAME.json and a rerun skips it (an interrupted run resumes); `jobs` > 1 fills the trace
    cache and replays the variants in that many one-thread child processes (`out` required), all sharing one
    calibration of this machine's costs (OUT/costs.json)."""
    from tandem.flywheel.replay import cached_trace_ids, target_traces
    from tandem.flywheel.setups import scratch_head
    from tandem.models.eagle import load_eagle

    if jobs < 1 or (jobs > 1 and out is None):
        raise InvalidParameterError(f"jobs must be >= 1 and jobs > 1 needs an output directory; got jobs={jobs}, out={out}")
    started = time.perf_counter()
    runs = VariantRuns(Path(out), cfg) if out is not None else None
    shift = cfg.shift_config()
    target, stream, stream_ids, taps, cache = _load_stream(cfg)
    pending = [name for name in cfg.variants if runs is None or not runs.done(name)]
    if jobs > 1 and pending and set(stream_ids) - (cached_trace_ids(cache) if cache.is_dir() else set()):
        runs.in_children([["traces", str(part), str(jobs)] for part in range(jobs)], jobs, log)
    costs = runs.costs(lambda: _calibrate(target, shift, cfg.seed)) if runs is not None else _calibrate(target, shift, cfg.seed)
    log(f"traces cached for {len(stream_ids)} distinct prompts of {len(stream)} requests; {len(pending)} variant(s) to replay")
    replayed: dict[str, dict] = {}
    if jobs > 1:
        runs.in_children([["variant", name] for name in sorted(pending, key=_expected_cost, reverse=True)], jobs, log)
    elif pending:
        traces = target_traces(target, stream_ids, cfg.max_tokens, taps, cache)
        heads = {"static": load_eagle(cfg.general_head, target), "scratch": scratch_head(target, shift.draft_vocab, cfg.seed)}
        for name in pending:
            replayed[name] = replay_variant(name, cfg, target, stream, traces, heads, costs)
            if runs is not None:
                runs.save(name, replayed[name])
            log(f"{name}: mean acceptance {_mean_acceptance(replayed[name]['rows']):.3f} ({replayed[name]['settings']['seconds']} s)")
    if runs is not None:
        replayed = {name: replayed[name] if name in replayed else runs.load(name) for name in cfg.variants}
    return _report(cfg, shift, stream, stream_ids, costs, replayed, started)


def _load_stream(cfg: AuroraConfig) -> tuple:
    """(target, stream, prompt ids by key, the head's taps, the trace cache directory) of a run."""
    from tandem.flywheel.replay import trace_cache_dir
    from tandem.llm import load_tokenizer
    from tandem.models.eagle import EagleConfig
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model, tandem_home

    shift = cfg.shift_config()
    model_dir = Path(resolve_model(shift.model))
    target = load_transformer(model_dir)
    target.pack()
    stream, stream_ids, _ = build_stream(shift.stream, load_tokenizer(model_dir))
    taps = EagleConfig.for_target(target.cfg).taps
    return target, stream, stream_ids, taps, trace_cache_dir(Path(tandem_home()), model_dir, cfg.max_tokens, taps)


def replay_variant(name: str, cfg: AuroraConfig, target, stream: list, traces: dict, heads: dict, costs: dict) -> dict:
    """One variant replayed: its per-request rows, the flywheel's metrics and the settings it ran under."""
    mode, vcfg = variant_config(name, cfg)
    begun = time.perf_counter()
    rows, extras = replay_mode(mode, target, stream, traces, heads, costs, vcfg)
    settings = {"mode": mode, "steps_per_request": vcfg.train_steps_per_request, "sample": vcfg.sample, "recent_share": vcfg.recent_share,
                "shift_detect": vcfg.shift_detect, "lr": vcfg.lr if mode == "online_scratch" else vcfg.finetune_lr,
                "anchor": 0.0 if mode == "online_scratch" else vcfg.anchor, "seconds": round(time.perf_counter() - begun, 1)}
    return {"rows": rows, "extras": extras, "settings": settings}


def _calibrate(target, shift: ShiftConfig, seed: int) -> dict:
    from tandem.flywheel.setups import scratch_head, serving_copy

    return calibrate(target, serving_copy(scratch_head(target, shift.draft_vocab, seed)), shift.num_draft_tokens)


def _mean_acceptance(rows: list[dict]) -> float:
    return sum(r["acceptance_length"] for r in rows) / len(rows)


def _expected_cost(name: str) -> int:
    """Children take the long variants first, so the short ones fill the gaps at the end."""
    return 0 if name in ("plain", "static") else 1


def _report(cfg: AuroraConfig, shift: ShiftConfig, stream: list, stream_ids: dict, costs: dict, replayed: dict, started: float) -> dict:
    summary = summarize({name: r["rows"] for name, r in replayed.items()}, shift)
    for name, r in replayed.items():
        rows = r["rows"]
        summary[name] |= r["extras"] | {"settings": r["settings"], "per_block": [b["acceptance_length"] for b in per_block(rows, cfg.block)],
                                        "after_first_block": after_first_block(rows, cfg.block),
                                        "recovery_within_block": recovery_within_block(rows, cfg.block, recovery_window(cfg))}
    counts: dict[str, int] = {}
    for p in stream:
        counts[prompt_key(p)] = counts.get(prompt_key(p), 0) + 1
    first = next(iter(replayed.values()))["rows"]
    return {"config": asdict(cfg), "machine": machine_info(), "seconds": round(time.perf_counter() - started, 1),
            "stream": {"requests": len(stream), "distinct_prompts": len(stream_ids), "repeated_requests": sum(n - 1 for n in counts.values()),
                       "blocks": [b["domain"] for b in per_block(first, cfg.block)]},
            "costs": _costs_json(costs), "summary": summary, "requests": {name: r["rows"] for name, r in replayed.items()}}


def _costs_json(costs: dict) -> dict:
    return {"verify_s": {str(k): v for k, v in costs["verify_s"].items()}, "draft_step_s": costs["draft_step_s"]}


# ---- a run directory: finished variants kept, children side by side ----------------------------------------------
class VariantRuns:
    """OUT/config.json (the run's settings, the general head's sha256 and the sha256 of tandem's sources: a rerun
    with other settings or other code is refused, not mixed in), OUT/costs.json (one calibration for every
    variant), OUT/variants/NAME.json (a finished variant), OUT/logs/ (the children's output)."""

    def __init__(self, out: Path, cfg: AuroraConfig):
        self.dir = out
        (out / "variants").mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        settings = _run_settings(cfg)
        path = out / "config.json"
        if path.exists():
            kept = json.loads(path.read_text())
            differ = sorted(k for k in settings.keys() | kept.keys() if settings.get(k) != kept.get(k))
            if differ:
                raise InvalidParameterError(f"{out} holds a run with other settings ({', '.join(differ)}); use another output directory")
        else:
            _write_json(path, settings)
        self.cfg = cfg

    def done(self, name: str) -> bool:
        return (self.dir / "variants" / f"{name}.json").is_file()

    def save(self, name: str, replayed: dict) -> None:
        _write_json(self.dir / "variants" / f"{name}.json", replayed)

    def load(self, name: str) -> dict:
        return json.loads((self.dir / "variants" / f"{name}.json").read_text())

    def costs(self, measure) -> dict:
        path = self.dir / "costs.json"
        if not path.exists():
            _write_json(path, _costs_json(measure()))
        kept = json.loads(path.read_text())
        return {"verify_s": {int(k): v for k, v in kept["verify_s"].items()}, "draft_step_s": kept["draft_step_s"]}

    def in_children(self, tasks: list[list[str]], jobs: int, log) -> None:
        """Run each task (`python -m tandem.bench.flywheel.aurora OUT TASK...`) in a one-thread child, `jobs` at a time."""
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        queue, running, failed = list(tasks), {}, []
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    task = queue.pop(0)
                    log_path = self.dir / "logs" / f"{'-'.join(task)}.log"
                    sink = open(log_path, "wb")
                    child = subprocess.Popen([sys.executable, "-m", "tandem.bench.flywheel.aurora", str(self.dir), *task], stdout=sink, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env)
                    running[child] = (task, log_path, sink)
                time.sleep(0.5)
                for child in [c for c in running if c.poll() is not None]:
                    task, log_path, sink = running.pop(child)
                    sink.close()
                    if child.returncode:
                        failed.append(f"{' '.join(task)} (exit {child.returncode}):\n{log_tail(log_path, 10)}")
                    else:
                        log(f"done: {' '.join(task)}")
        finally:
            for child, (_, _, sink) in running.items():
                child.terminate()
                child.wait(timeout=60)
                sink.close()
        if failed:
            raise TandemError("bench aurora: child process(es) failed:\n" + "\n".join(failed))


def _costs_missing() -> dict:
    raise TandemError("costs.json is missing: the parent calibrates before it starts the variant children")


def _run_settings(cfg: AuroraConfig) -> dict:
    import hashlib

    settings = {k: v for k, v in asdict(cfg).items() if k != "variants"}  # a rerun may ask for more variants
    settings["domains"] = list(settings["domains"])
    weights = Path(cfg.general_head) / "model.safetensors"
    settings["general_head_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
    settings["source_sha256"] = source_sha256()  # a variant replayed by other code is not mixed in either
    return settings


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)  # a run cut off mid-write leaves no half file behind


def _child(out: Path, task: list[str]) -> None:
    """A child of `VariantRuns.in_children`: fill part of the trace cache, or replay one variant."""
    import torch

    from tandem.flywheel.replay import fill_trace_cache, target_traces
    from tandem.flywheel.setups import scratch_head
    from tandem.models.eagle import load_eagle

    torch.set_num_threads(1)
    kept = json.loads((out / "config.json").read_text())
    cfg = AuroraConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in kept.items() if k in AuroraConfig.__dataclass_fields__})
    shift = cfg.shift_config()
    target, stream, stream_ids, taps, cache = _load_stream(cfg)
    if task[0] == "traces":
        part, parts = int(task[1]), int(task[2])
        keys = list(stream_ids)[part::parts]
        print(f"generated {fill_trace_cache(target, {k: stream_ids[k] for k in keys}, cfg.max_tokens, taps, cache)} traces", flush=True)
        return
    runs = VariantRuns(out, cfg)
    traces = target_traces(target, stream_ids, cfg.max_tokens, taps, cache)
    heads = {"static": load_eagle(cfg.general_head, target), "scratch": scratch_head(target, shift.draft_vocab, cfg.seed)}
    replayed = replay_variant(task[1], cfg, target, stream, traces, heads, runs.costs(_costs_missing))
    runs.save(task[1], replayed)
    print(f"{task[1]}: mean acceptance {_mean_acceptance(replayed['rows']):.3f} ({replayed['settings']['seconds']} s)", flush=True)


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


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2:])
