"""`tandem bench shift`: acceptance over a domain-shifting stream, static drafter vs the flywheel.

The stream is N requests in blocks of B per domain (code -> sql -> math -> chat -> translation -> ...),
greedy. Modes (`tandem.flywheel.setups.MODES`, where the flywheel's composition lives):
- plain: no drafter (replay: modelled as one verify forward per token);
- static: an EAGLE head trained offline on the first domain only (its train split), or --static-head, frozen
  (live: served bare, as a user would run it: no trace recording, no collector, no hot-swapper);
- online: that head, then the flywheel (traces -> buffer -> trainer -> hot-swap), fine-tuned at
  `finetune_lr` and anchored to its starting weights;
- online_scratch: the flywheel from an untrained head (day-0 deployment), at `lr`;
- online_discard / online_no_discard / online_no_branch / online_scratch_no_discard: ablations of the loss
  terms (the discard term is off by default: it lowered greedy acceptance in every replay measured).

`--replay` (the default on this CPU): the target's greedy continuations and hidden states are computed
once per prompt and cached (tandem.flywheel.replay); each mode replays its drafter's acceptance exactly,
feeds the same traces the engine would record into the buffer, and runs the trainer steps one trainer core
affords while the request is served (its modelled seconds against the measured step time; or a fixed
`train_steps_per_request`) after each request, publishing every `publish_every` steps through the same WeightStore /
HotSwapper (validation, in-place copy, rollback) the live engine uses. Tokens/s in replay is modelled
from this machine's measured verify and draft costs (`calibrate`). Without --replay the live engine serves
the stream (`live_mode`) with the trainer in a child process when the machine has >= 2 cores (`--trainer
thread`: a background thread of the serving process, which competes with the engine for the interpreter
lock), 1 torch thread for the engine and 1 for the trainer in every mode.

Per request: domain, acceptance length, tokens/s, drafter version. Per mode: mean acceptance length, its
ratio to static, per-domain means, and the recovery after each shift: requests until the rolling mean
(window W) of acceptance length returns to 90% of the mode's mean over the block before.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.bench.machine import machine_info
from tandem.data.prompts import DOMAINS, Prompt
from tandem.flywheel.stream import StreamSpec, prompt_key
from tandem.flywheel.stream import build_stream as stream_build
from tandem.flywheel.stream_stats import summarize
from tandem.config import SamplingParams
from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE
from tandem.errors import InvalidParameterError
from tandem.flywheel.replay import target_traces, trace_cache_dir
from tandem.flywheel.setups import (MODES, FlywheelSetup, ReplayFlywheel, check_modes, live_engine, pinned, scratch_head, serve_stream, serving_copy,
                                    serving_cores, train_static_head, trainer_process_pays)
from tandem.models.eagle import EagleConfig, EagleHead, load_eagle, save_eagle


@dataclass(frozen=True)
class ShiftConfig:
    model: str = "smollm2-135m"
    drafter: str = "eagle"
    prompts: str = "builtin"
    requests: int = 2000
    block: int = 200
    domains: tuple[str, ...] = DOMAINS
    modes: tuple[str, ...] = ("static", "online", "online_scratch", "online_discard")
    replay: bool = True
    max_tokens: int = 64
    num_draft_tokens: int = 4
    max_prompt_tokens: int = 448  # longer prompts are left out of the stream
    draft_vocab: int = 8192
    top_up: bool = False  # more math variants / extra SQL prompts where a domain's pool is shorter than the stream needs
    static_prompts: int = 200  # first-domain train-split prompts the static head learns from
    static_steps: int = 300
    static_head: str | None = None  # use this head as `static` instead of training one
    train_steps_per_request: float | None = FlywheelSetup.steps_per_request  # replay: trainer steps after each request; None = what one trainer core affords
    publish_every: int = FlywheelSetup.publish_every
    batch_size: int = FlywheelSetup.batch_size  # trainer batch (traces)
    lr: float = FlywheelSetup.lr  # online_scratch (a day-0 head)
    finetune_lr: float = FlywheelSetup.finetune_lr  # online modes starting from the static head
    anchor: float = FlywheelSetup.anchor  # ... pulled toward it
    discard_weight: float = FlywheelSetup.discard_weight  # mode online_discard turns it on
    branch_weight: float = FlywheelSetup.branch_weight
    window: int = 20  # rolling window (requests) of the recovery measure
    collapse_ratio: float = FlywheelSetup.collapse_ratio
    sample: str = FlywheelSetup.sample  # the trainer's replay draw: uniform | domains
    recent_share: float = FlywheelSetup.recent_share  # share of each batch from the newest recent_window traces
    recent_window: int = FlywheelSetup.recent_window
    shift_detect: bool = FlywheelSetup.shift_detect  # replay: boost steps / warm lr after a detected acceptance drop
    boost_steps_per_request: float = FlywheelSetup.boost_steps_per_request
    boost_requests: int = FlywheelSetup.boost_requests
    boost_lr: float = FlywheelSetup.boost_lr
    shift_drop: float = FlywheelSetup.shift_drop
    seed: int = 0
    live_batch: int = 4  # live mode: concurrent requests
    min_confidence: float = TRAINED_MIN_CONFIDENCE  # live, a trained starting head: its chains end below this path confidence, as served by default (0: full chains)
    prompt_lookup: bool = False  # graft a prompt-lookup branch onto every head's draft (the demo's drafter, eagle_ngram): live, serve it; replay, also report it
    covered_weight: float = FlywheelSetup.covered_weight  # with prompt_lookup: the trainer's imitation weight where the branch already drafts right
    trainer_process: bool | None = None  # live mode: train in a child process (True) or a thread (False); None: a process when there are >= 2 cores
    trainer_core: bool = True  # live mode, trainer process: it trains on a core of its own, every mode serves on the others

    @property
    def stream(self) -> StreamSpec:
        return StreamSpec(prompts=self.prompts, requests=self.requests, block=self.block, domains=self.domains, max_prompt_tokens=self.max_prompt_tokens,
                          static_prompts=self.static_prompts, top_up=self.top_up, seed=self.seed)

    @property
    def setup(self) -> FlywheelSetup:
        return FlywheelSetup(num_draft_tokens=self.num_draft_tokens, batch_size=self.batch_size, lr=self.lr, finetune_lr=self.finetune_lr, anchor=self.anchor, publish_every=self.publish_every,
                             discard_weight=self.discard_weight, branch_weight=self.branch_weight, collapse_ratio=self.collapse_ratio, seed=self.seed,
                             sample=self.sample, recent_share=self.recent_share, recent_window=self.recent_window, shift_detect=self.shift_detect, boost_steps_per_request=self.boost_steps_per_request,
                             boost_requests=self.boost_requests, boost_lr=self.boost_lr, shift_drop=self.shift_drop,
                             trainer_process=trainer_process_pays() if self.trainer_process is None else self.trainer_process,
                             trainer_core=self.trainer_core, min_confidence=self.min_confidence, prompt_lookup=self.prompt_lookup,
                             covered_weight=self.covered_weight, steps_per_request=self.train_steps_per_request)

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        object.__setattr__(self, "modes", tuple(self.modes))
        if self.drafter != "eagle":
            raise InvalidParameterError(f"bench shift trains EAGLE heads; drafter {self.drafter!r} is not supported")
        check_modes(self.modes)
        if self.requests < 1 or self.block < 1 or self.window < 1 or self.max_tokens < 2:
            raise InvalidParameterError("requests, block, window >= 1 and max_tokens >= 2 are required")


# ---- the stream (tandem.flywheel.stream) ---------------------------------------------------------------------------
def build_stream(cfg: ShiftConfig, tokenizer):
    return stream_build(cfg.stream, tokenizer)


# ---- heads ---------------------------------------------------------------------------------------------------------
def static_head(target, traces: list, cfg: ShiftConfig, cache: Path) -> tuple[EagleHead, dict]:
    """--static-head, or the head trained on the first domain (cached next to the target traces)."""
    if cfg.static_head:
        return load_eagle(cfg.static_head, target), {"loaded_from": cfg.static_head}
    key = f"static-{cfg.domains[0]}-p{cfg.static_prompts}-s{cfg.static_steps}-v{cfg.draft_vocab}-k{cfg.num_draft_tokens}-seed{cfg.seed}"
    path = cache / key
    if (path / "eagle_config.json").exists():
        return load_eagle(path, target), {"loaded_from": str(path)}
    head, report = train_static_head(target, traces, cfg.static_steps, cfg.draft_vocab, cfg.setup)
    save_eagle(head, path)
    return head, report | {"saved_to": str(path)}


# ---- costs (replay tokens/s) ----------------------------------------------------------------------------------------
@torch.inference_mode()
def calibrate(target, head: EagleHead, k: int, context: int = 160, repeats: int = 5) -> dict:
    """Median seconds of a target verify forward over 1..k+1 tokens at `context`, and of one head step."""
    from tandem.models.kv_cache import KVCache

    cache = KVCache(target.cfg, 1, context + k + 2, target.embed.weight.dtype, "cpu")
    target(torch.randint(0, 1000, (1, context)), cache=cache, last_only=True)
    verify = {}
    for t in range(1, k + 2):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target(torch.randint(0, 1000, (1, t)), cache=cache, taps=head.cfg.taps)
            times.append(time.perf_counter() - start)
            cache.truncate(0, context)
        verify[t] = sorted(times)[len(times) // 2]
    draft_cache = KVCache(head.cfg.layer_config(), 1, context + k + 2, torch.float32, "cpu")
    d = head.cfg.hidden_size
    head(torch.zeros(1, context, dtype=torch.long), torch.zeros(1, context, d), cache=draft_cache, logits_at=torch.tensor([context - 1]))
    times = []
    for _ in range(repeats * 2):
        start = time.perf_counter()
        head(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, d), cache=draft_cache)
        times.append(time.perf_counter() - start)
        draft_cache.truncate(0, context)
    return {"verify_s": verify, "draft_step_s": sorted(times)[len(times) // 2]}


def modelled_seconds(steps: list[tuple[int, int, int]], costs: dict) -> float:
    """A request's decode time on this machine's calibrated costs (one stream): a verify and k draft steps per step."""
    return sum(costs["verify_s"][drafted + 1] + drafted * costs["draft_step_s"] for _, drafted, _ in steps)


def modelled_tokens_per_s(steps: list[tuple[int, int, int]], output_tokens: int, costs: dict) -> float:
    seconds = modelled_seconds(steps, costs)
    return (output_tokens - 1) / seconds if seconds else 0.0


# ---- modes --------------------------------------------------------------------------------------------------------
def replay_mode(mode: str, target, stream: list[Prompt], traces: dict, heads: dict[str, EagleHead], costs: dict, cfg: ShiftConfig) -> tuple[list[dict], dict]:
    if MODES[mode][0] is None:  # plain decoding: one verify forward of one token per output token
        rows = [{"i": i, "domain": p.domain, "acceptance_length": 1.0, "tokens_per_s": round(1.0 / costs["verify_s"][1], 3), "version": 0}
                for i, p in enumerate(stream)]
        return rows, {}
    flywheel = ReplayFlywheel(mode, target, heads, cfg.setup, lambda steps: modelled_seconds(steps, costs))
    rows, serve_s = [], 0.0
    for i, prompt in enumerate(tqdm(stream, desc=mode, unit="req", disable=None)):
        result, version = flywheel.serve(traces[prompt_key(prompt)], cfg.max_tokens)
        serve_s += modelled_seconds(result.steps, costs)
        rows.append({"i": i, "domain": prompt.domain, "acceptance_length": round(result.acceptance_length, 4),
                     "tokens_per_s": round(modelled_tokens_per_s(result.steps, result.output_tokens, costs), 3), "version": version})
        if result.deployed is not None:  # --prompt-lookup: the drafter as eagle_ngram deploys it, beside the head's chain
            rows[-1]["deployed_acceptance_length"] = round(result.deployed_acceptance_length, 4)
    metrics = flywheel.metrics()
    if "trainer_s" in metrics:  # the trainer's wall time over the stream's modelled decode time: <= 1 means a core of its own keeps pace
        metrics |= {"modelled_serve_s": round(serve_s, 1), "trainer_core_load": round(metrics["trainer_s"] / serve_s, 3) if serve_s else None}
    return rows, metrics


def live_mode(mode: str, target, stream: list[Prompt], stream_ids: dict[str, list[int]], heads: dict[str, EagleHead], cfg: ShiftConfig) -> tuple[list[dict], dict]:
    torch.set_num_threads(1)
    longest = max(len(ids) for ids in stream_ids.values()) + cfg.max_tokens + 1
    serving = serving_cores(cfg.setup)
    with pinned(serving):
        engine, flywheel = live_engine(mode, target, heads, cfg.setup, cfg.live_batch, longest)
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)
        with tqdm(total=len(stream), desc=f"{mode} (live)", unit="req", disable=None) as bar:
            result = serve_stream(engine, flywheel, [(stream_ids[prompt_key(p)], p.domain) for p in stream], params, cfg.live_batch,
                                  on_finish=lambda row: bar.update(1), prefix=mode)
        if flywheel is not None:
            flywheel.close()
    extra = {"stream_tokens_per_s": round(result.tokens_per_s, 3), "serving_cores": list(serving) if serving else None,
             "lost_requests": len(stream) - len(result.rows)}
    if flywheel is not None:
        metrics = flywheel.metrics()
        step_ms = 1000 * (metrics["median_step_s"] or 0.0)
        extra |= metrics | {"trainer_process": flywheel.options.trainer_process,
                            "trainer_cores": list(flywheel.options.trainer_cpus) if flywheel.options.trainer_cpus else None,
                            # the longest weight install (the stall a swap adds to its step) in median decode steps
                            "swap_stall_steps": round(metrics["swaps"]["max_swap_ms"] / step_ms, 3) if step_ms else None}
    return result.rows, extra


# ---- the whole benchmark ----------------------------------------------------------------------------------------
def run_shift_bench(cfg: ShiftConfig, plot: str | None = None) -> dict:
    from tandem.llm import load_tokenizer
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model, tandem_home

    started = time.perf_counter()
    model_dir = Path(resolve_model(cfg.model))
    target = load_transformer(model_dir)
    target.pack()
    stream, stream_ids, static_ids = build_stream(cfg, load_tokenizer(model_dir))
    taps = EagleConfig.for_target(target.cfg).taps
    cache = trace_cache_dir(Path(tandem_home()), model_dir, cfg.max_tokens, taps)
    traces = target_traces(target, stream_ids | static_ids, cfg.max_tokens, taps, cache)
    heads, static_report = {"scratch": scratch_head(target, cfg.draft_vocab, cfg.seed)}, {}
    if any(MODES[m][0] == "static" for m in cfg.modes):
        heads["static"], static_report = static_head(target, [traces[k] for k in static_ids], cfg, cache)
    costs = calibrate(target, serving_copy(heads["scratch"]), cfg.num_draft_tokens)
    if not cfg.replay:
        results = {mode: live_mode(mode, target, stream, stream_ids, heads, cfg) for mode in cfg.modes}
        extras = {mode: results[mode][1] for mode in cfg.modes}
        results = {mode: results[mode][0] for mode in cfg.modes}
    else:
        extras, results = {}, {}
        for mode in cfg.modes:
            results[mode], extras[mode] = replay_mode(mode, target, stream, traces, heads, costs, cfg)
    summary = summarize(results, cfg)
    for mode, extra in extras.items():
        summary[mode] |= extra
    report = {
        "config": asdict(cfg), "machine": machine_info(), "stream": {"requests": len(stream), "unique_prompts": len(stream_ids)},
        "static_head_training": static_report, "costs": {"verify_s": {str(k): v for k, v in costs["verify_s"].items()}, "draft_step_s": costs["draft_step_s"]},
        "summary": summary, "seconds": round(time.perf_counter() - started, 1), "requests": results,
    }
    if plot:
        from tandem.flywheel.stream_plot import plot_shift

        report["plot"] = str(plot_shift(results, cfg, plot))
    return report

