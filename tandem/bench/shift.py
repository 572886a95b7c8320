"""`tandem bench shift`: acceptance over a domain-shifting stream, static drafter vs the flywheel.

The stream is N requests in blocks of B per domain (code -> sql -> math -> chat -> translation -> ...),
greedy. Modes (`MODES`):
- static: an EAGLE head trained offline on the first domain only (its train split), frozen;
- online: that head, then the flywheel (traces -> buffer -> trainer -> hot-swap);
- online_scratch: the flywheel from an untrained head (day-0 deployment);
- online_no_discard / online_no_branch / online_scratch_no_discard: ablations of the loss terms.

`--replay` (the default on this CPU): the target's greedy continuations and hidden states are computed
once per prompt and cached (tandem.flywheel.replay); each mode replays its drafter's acceptance exactly,
feeds the same traces the engine would record into the buffer, and runs `train_steps_per_request`
trainer steps after each request, publishing every `publish_every` steps through the same WeightStore /
HotSwapper (validation, in-place copy, rollback) the live engine uses. Tokens/s in replay is modelled
from this machine's measured verify and draft costs (`calibrate`). Without --replay the live engine serves
the stream with the trainer in a background thread (`live_mode`).

Per request: domain, acceptance length, tokens/s, drafter version. Per mode: mean acceptance length, its
ratio to static, per-domain means, and the recovery after each shift: requests until the rolling mean
(window W) of acceptance length returns to 90% of the mode's mean over the block before.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.bench.machine import machine_info
from tandem.bench.prompts import DOMAINS, Prompt, domain_stream, load_prompts, prompt_split, render_chat
from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.replay import replay_request, replay_trace, target_traces, trace_cache_dir
from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
from tandem.flywheel.weights import HotSwapper, WeightStore
from tandem.models.eagle import EagleConfig, EagleHead, draft_vocab_from_tokens, load_eagle, new_eagle_head, save_eagle

# mode -> (initial head, flywheel loss switches or None for a frozen head)
MODES: dict[str, tuple[str, dict | None]] = {
    "static": ("static", None),
    "scratch": ("scratch", None),
    "online": ("static", {}),
    "online_scratch": ("scratch", {}),
    "online_no_discard": ("static", {"discard_weight": 0.0}),
    "online_no_branch": ("static", {"branch_weight": 0.0}),
    "online_scratch_no_discard": ("scratch", {"discard_weight": 0.0}),
    "online_discard_only": ("static", {"imitation": False, "branch_weight": 0.0}),
}


@dataclass(frozen=True)
class ShiftConfig:
    model: str = "smollm2-135m"
    drafter: str = "eagle"
    prompts: str = "builtin"
    requests: int = 2000
    block: int = 200
    domains: tuple[str, ...] = DOMAINS
    modes: tuple[str, ...] = ("static", "online", "online_scratch", "online_no_discard")
    replay: bool = True
    max_tokens: int = 64
    num_draft_tokens: int = 4
    max_prompt_tokens: int = 448  # longer prompts are left out of the stream
    draft_vocab: int = 8192
    static_prompts: int = 200  # first-domain train-split prompts the static head learns from
    static_steps: int = 300
    static_head: str | None = None  # use this head as `static` instead of training one
    train_steps_per_request: float = 0.5  # replay: trainer steps after each request (the trainer's share of compute)
    publish_every: int = 10
    batch_size: int = 4  # trainer batch (traces)
    lr: float = 1e-3
    discard_weight: float = 0.5
    branch_weight: float = 0.5
    window: int = 20  # rolling window (requests) of the recovery measure
    collapse_ratio: float = 0.5
    seed: int = 0
    live_batch: int = 4  # live mode: concurrent requests

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        object.__setattr__(self, "modes", tuple(self.modes))
        if self.drafter != "eagle":
            raise InvalidParameterError(f"bench shift trains EAGLE heads; drafter {self.drafter!r} is not supported")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise InvalidParameterError(f"unknown mode(s) {unknown}; available: {', '.join(MODES)}")
        if self.requests < 1 or self.block < 1 or self.window < 1 or self.max_tokens < 2:
            raise InvalidParameterError("requests, block, window >= 1 and max_tokens >= 2 are required")


# ---- the stream ---------------------------------------------------------------------------------------------------
def build_stream(cfg: ShiftConfig, tokenizer) -> tuple[list[Prompt], dict[str, list[int]], dict[str, list[int]]]:
    """(stream prompts, their token ids by key, static-head training ids by key). The static head's
    prompts (first domain, train split) never appear in the stream."""
    first = cfg.domains[0]
    static_ids: dict[str, list[int]] = {}
    if cfg.static_prompts:
        static_pool = load_prompts(cfg.prompts, domains=[first], split="train" if cfg.prompts == "builtin" else "all", seed=cfg.seed)
        static_ids = dict(list(_keyed_ids(static_pool[: 2 * cfg.static_prompts], tokenizer, cfg.max_prompt_tokens).items())[: cfg.static_prompts])
    pool = [p for p in load_prompts(cfg.prompts, domains=cfg.domains, seed=cfg.seed) if _key(p) not in static_ids]
    if cfg.prompts == "builtin":
        pool = [p for p in pool if p.domain != first or prompt_split(p) == "test"]
    ids = _keyed_ids(pool, tokenizer, cfg.max_prompt_tokens)
    pool = [p for p in pool if _key(p) in ids]
    stream = domain_stream(pool, cfg.requests, cfg.block, cfg.domains, cfg.seed)
    return stream, {_key(p): ids[_key(p)] for p in stream}, static_ids


def _key(prompt: Prompt) -> str:
    return f"{prompt.domain}:{prompt.id or hashlib.sha256(prompt.prompt.encode()).hexdigest()[:16]}"


def _keyed_ids(prompts: list[Prompt], tokenizer, max_len: int) -> dict[str, list[int]]:
    rendered = render_chat(prompts, tokenizer)
    return {_key(p): ids for p, ids in zip(prompts, rendered) if len(ids) <= max_len}


# ---- heads ---------------------------------------------------------------------------------------------------------
def train_static_head(target, traces: list, cfg: ShiftConfig) -> tuple[EagleHead, dict]:
    from tandem.training.offline import TrainConfig, fit, step_function, target_example

    taps = EagleConfig.for_target(target.cfg).taps  # traces keep the target's distribution at generated positions only: recompute
    examples = [target_example(target, t.tokens.tolist(), t.prompt_len, taps) for t in traces]
    vocab = draft_vocab_from_tokens((e.tokens.tolist() for e in examples), min(cfg.draft_vocab, target.cfg.vocab_size), target.cfg.vocab_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    head = new_eagle_head(target, EagleConfig.for_target(target.cfg, len(vocab)), vocab, generator)
    train_cfg = TrainConfig(steps=cfg.static_steps, unroll=cfg.num_draft_tokens, draft_vocab=cfg.draft_vocab, seed=cfg.seed)
    start = time.perf_counter()
    losses = fit(head, step_function(train_cfg, head, target_lm_rows(target, head), generator), examples, train_cfg, generator)
    return head, {"steps": len(losses), "seconds": round(time.perf_counter() - start, 1), "loss_first": round(losses[0], 4), "loss_last": round(sum(losses[-10:]) / 10, 4)}


def static_head(target, traces: list, cfg: ShiftConfig, cache: Path) -> tuple[EagleHead, dict]:
    """--static-head, or the head trained on the first domain (cached next to the target traces)."""
    if cfg.static_head:
        return load_eagle(cfg.static_head, target), {"loaded_from": cfg.static_head}
    key = f"static-{cfg.domains[0]}-p{cfg.static_prompts}-s{cfg.static_steps}-v{cfg.draft_vocab}-k{cfg.num_draft_tokens}-seed{cfg.seed}"
    path = cache / key
    if (path / "eagle_config.json").exists():
        return load_eagle(path, target), {"loaded_from": str(path)}
    head, report = train_static_head(target, traces, cfg)
    save_eagle(head, path)
    return head, report | {"saved_to": str(path)}


def scratch_head(target, cfg: ShiftConfig) -> EagleHead:
    """Day 0: an untrained head over the target's lowest draft_vocab ids (BPE's most common merges)."""
    config = EagleConfig.for_target(target.cfg, cfg.draft_vocab)
    return new_eagle_head(target, config, draft_vocab_from_tokens([], config.draft_vocab_size, target.cfg.vocab_size), torch.Generator().manual_seed(cfg.seed))


def _serving(head: EagleHead) -> EagleHead:
    served = trainer_copy(head).eval().requires_grad_(False)
    served.pack()
    return served


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


def modelled_tokens_per_s(steps: list[tuple[int, int, int]], output_tokens: int, costs: dict) -> float:
    seconds = sum(costs["verify_s"][drafted + 1] + drafted * costs["draft_step_s"] for _, drafted, _ in steps)
    return (output_tokens - 1) / seconds if seconds else 0.0


# ---- replay modes --------------------------------------------------------------------------------------------------
def replay_mode(mode: str, target, stream: list[Prompt], traces: dict, heads: dict[str, EagleHead], costs: dict, cfg: ShiftConfig) -> tuple[list[dict], dict]:
    init, switches = MODES[mode]
    served = _serving(heads[init])
    drafter = _ServedHead(served)
    store, buffer, trainer, swapper = WeightStore(), TraceBuffer(), None, None
    if switches is not None:
        flywheel = flywheel_config(cfg, switches)
        trainer = OnlineTrainer(trainer_copy(heads[init]), target_lm_rows(target, heads[init]), buffer, store, flywheel)
        swapper = HotSwapper(drafter, store, collapse_ratio=cfg.collapse_ratio, background=False)
    rows, credit = [], 0.0
    for i, prompt in enumerate(tqdm(stream, desc=mode, unit="req", disable=None)):
        trace = traces[_key(prompt)]
        result = replay_request(served, trace, cfg.num_draft_tokens, cfg.max_tokens)
        rows.append({"i": i, "domain": prompt.domain, "acceptance_length": round(result.acceptance_length, 4),
                     "tokens_per_s": round(modelled_tokens_per_s(result.steps, result.output_tokens, costs), 3), "version": drafter.version})
        if trainer is None:
            continue
        buffer.put(replay_trace(trace, result, drafter.version))
        swapper.observe_lengths(drafter.version, [accepted + 1 for _, drafted, accepted in result.steps if drafted])
        credit += cfg.train_steps_per_request
        while credit >= 1.0:
            trainer.train_step()
            credit -= 1.0
        swapper()
    extra = {} if swapper is None else {"swaps": swapper.stats.as_dict(), "trainer_steps": trainer.steps, "buffer": asdict(buffer.stats())}
    return rows, extra


def flywheel_config(cfg: ShiftConfig, switches: dict) -> FlywheelConfig:
    base = {"unroll": cfg.num_draft_tokens, "batch_size": cfg.batch_size, "lr": cfg.lr, "publish_every": cfg.publish_every,
            "discard_weight": cfg.discard_weight, "branch_weight": cfg.branch_weight, "seed": cfg.seed}
    return FlywheelConfig(**(base | switches))


class _ServedHead:
    """What HotSwapper needs of a drafter in replay: the served head and its version."""

    def __init__(self, head: EagleHead):
        self.head, self.version = head, 0


# ---- summary --------------------------------------------------------------------------------------------------------
def rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def recovery(rows: list[dict], block: int, window: int, level: float = 0.9) -> list[dict]:
    """After each shift: requests until the rolling mean (over the new block only) reaches `level` x the
    mean of the block before; None if it never does within the block."""
    values = [r["acceptance_length"] for r in rows]
    out = []
    for start in range(block, len(values), block):
        before = values[start - block : start]
        target = level * sum(before) / len(before)
        block_values = values[start : start + block]
        roll = rolling(block_values, window)
        hit = next((j + 1 for j, v in enumerate(roll) if j + 1 >= min(window, len(block_values)) and v >= target), None)
        out.append({"at": start, "domain": rows[start]["domain"], "previous_level": round(target / level, 4), "requests": hit})
    return out


def summarize(results: dict[str, list[dict]], cfg: ShiftConfig) -> dict:
    summary = {}
    static_mean = _mean([r["acceptance_length"] for r in results["static"]]) if "static" in results else None
    for mode, rows in results.items():
        values = [r["acceptance_length"] for r in rows]
        shifts = recovery(rows, cfg.block, cfg.window)
        recovered = [s["requests"] for s in shifts if s["requests"] is not None]
        tail = rows[-cfg.block :]
        summary[mode] = {
            "mean_acceptance_length": round(_mean(values), 4),
            "ratio_to_static": round(_mean(values) / static_mean, 4) if static_mean else None,
            "mean_tokens_per_s": round(_mean([r["tokens_per_s"] for r in rows]), 3),
            "last_block_acceptance_length": round(_mean([r["acceptance_length"] for r in tail]), 4),
            "per_domain": {d: round(_mean([r["acceptance_length"] for r in rows if r["domain"] == d]), 4) for d in cfg.domains},
            "recovery": shifts,
            "recovered_shifts": f"{len(recovered)}/{len(shifts)}",
            "max_recovery_requests": max(recovered) if recovered else None,
            "max_recovery_fraction": round(max(recovered) / len(rows), 4) if recovered else None,
        }
    return summary


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


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
    heads, static_report = {"scratch": scratch_head(target, cfg)}, {}
    if any(MODES[m][0] == "static" for m in cfg.modes):
        heads["static"], static_report = static_head(target, [traces[k] for k in static_ids], cfg, cache)
    costs = calibrate(target, _serving(heads["scratch"]), cfg.num_draft_tokens)
    if not cfg.replay:
        from tandem.bench.shift_live import live_mode

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
        from tandem.bench.shift_plot import plot_shift

        report["plot"] = str(plot_shift(results, cfg, plot))
    return report

