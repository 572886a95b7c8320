"""The flywheel's serving set-ups: which head a mode starts from, whether it trains, and how it serves.

A *mode* (`MODES`) is an initial head ("static": trained offline and given; "scratch": untrained, day 0;
None: no drafter, plain decoding) and the flywheel's loss switches (None: the head stays frozen). Two
ways to serve a stream under a mode:

- `ReplayFlywheel`: exact greedy acceptance replay (tandem.flywheel.replay) against cached target traces;
  each served request's trace goes to the buffer, the trainer takes the steps one trainer core affords (or
  `steps_per_request`), and
  the same WeightStore / HotSwapper (validation, in-place copy, rollback reaching the trainer) as live
  serving adopts new versions;
- `live_engine` + `serve_stream`: the real engine serves the requests with `batch` in flight, the
  trainer runs in a background thread or, with `trainer_process`, in a child process (`Flywheel`).

`bench shift` and `tandem demo` compose these; nothing here knows about benchmarks or prompts files.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters.eagle import EagleDrafter
from tandem.drafters.hybrid import EagleNgramDrafter
from tandem.drafters.ngram import NgramDrafter
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.loop import Flywheel, FlywheelOptions
from tandem.flywheel.pace import CoreBudget
from tandem.flywheel.objective import Lookup
from tandem.flywheel.replay import ReplayResult, replay_request, replay_trace
from tandem.flywheel.schedule import ShiftDetector, ShiftDetectorConfig, StepSchedule, StepScheduleConfig
from tandem.flywheel.traces import SequenceTrace
from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
from tandem.flywheel.weights import HotSwapper, WeightStore
from tandem.models.eagle import EagleConfig, EagleHead, draft_vocab_from_tokens, new_eagle_head

# mode -> (initial head: "static" | "scratch" | None for plain decoding, flywheel loss switches or None for a frozen head)
MODES: dict[str, tuple[str | None, dict | None]] = {
    "plain": (None, None),
    "static": ("static", None),
    "scratch": ("scratch", None),
    "online": ("static", {}),
    "online_scratch": ("scratch", {}),
    "online_no_discard": ("static", {"discard_weight": 0.0}),
    "online_discard": ("static", {"discard_weight": 0.5}),
    "online_no_branch": ("static", {"branch_weight": 0.0}),
    "online_scratch_no_discard": ("scratch", {"discard_weight": 0.0}),
    "online_discard_only": ("static", {"imitation": False, "branch_weight": 0.0}),
}


@dataclass(frozen=True)
class FlywheelSetup:
    """How every mode drafts and trains (one value for a whole comparison).

    Its field defaults are the flywheel's one set of defaults: what `tandem serve --online`, `tandem bench shift`,
    `tandem bench aurora`'s full online rung, the demo and the library start from (`DEFAULTS`; the fields named in
    `LEARNING` are the learning settings, measured best from a general head on specialised traffic:
    docs/BENCHMARKS.md 10). An entry point overrides a field explicitly, never keeps defaults of its own."""

    num_draft_tokens: int = 4  # chain length drafted per step
    batch_size: int = 4  # trainer batch (traces)
    lr: float = 1e-3  # learning rate from a day-0 head
    finetune_lr: float = 3e-4  # from a trained (static) head (the sweep from a general head: docs/BENCHMARKS.md 10)
    anchor: float = 0.0  # from a trained head: pull toward its weights (FlywheelConfig.anchor); 0 = off (10 cost 2 points from a general head)
    publish_every: int = 10  # trainer steps between published versions (a delivery cadence, not a learning setting: the demo's short run publishes every 5)
    discard_weight: float = 0.0  # off: on greedy replay it lowered acceptance in every comparison (docs/BENCHMARKS.md 4)
    branch_weight: float = 0.5
    collapse_ratio: float = 0.5  # rollback when a new version's acceptance falls below this x the old one's
    watch_window: int = 64  # request-steps a swapped-in version is watched over (live)
    trainer_duty: float = 1.0  # live: the trainer thread's busy share of wall time
    trainer_process: bool = False  # live: train in a child process (1 torch thread) instead of a thread of the serving process
    trainer_core: bool = False  # live, with trainer_process: the child trains on a core of its own and serving keeps the others (`core_split`)
    adaptive_k: bool = False  # live: the speculation controller picks k (0 = plain) per step from measured acceptance
    prompt_lookup: bool = False  # live: graft a prompt-lookup branch onto the head's draft (tandem.drafters.hybrid); replay: also replay that drafter
    min_confidence: float = 0.0  # live, from a trained head: chains end below this path confidence (EagleDrafter); replay models full chains
    sample: str = "domains"  # the trainer's replay draw: "uniform" over traces or "domains" (balanced; FlywheelConfig.sample)
    recent_share: float = 0.5  # ... of which this share of each batch comes from the newest recent_window traces (FlywheelConfig.recent_share)
    recent_window: int = 32
    steps_per_request: float | None = None  # replay: trainer steps per served request; None = what one trainer core affords (CoreBudget)
    shift_detect: bool = True  # replay: a detected acceptance drop warms the lr (and boosts the step rate above a fixed one; tandem.flywheel.schedule)
    boost_steps_per_request: float = 0.0  # ... right after a shift, decaying to the steady rate over boost_requests (at most the steady rate: none)
    boost_requests: int = 64
    boost_lr: float = 2.0
    shift_drop: float = 0.15  # the detector fires when recent acceptance < (1 - shift_drop) x its baseline
    pace_margin: float | None = None  # None: the trainer steps whenever it can; else it rests while its newest traces are learnt (FlywheelConfig.pace_margin; not yet measured)
    covered_weight: float = 1.0  # with prompt_lookup: imitation weight where the lookup branch already drafts right (FlywheelConfig.covered_weight; 1 = off)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1 or not 0 < self.collapse_ratio <= 1 or self.watch_window < 1 or not 0 < self.trainer_duty <= 1:
            raise InvalidParameterError("num_draft_tokens >= 1, collapse_ratio and trainer_duty in (0, 1] and watch_window >= 1 are required")
        if self.steps_per_request is not None and self.steps_per_request < 0:
            raise InvalidParameterError(f"steps_per_request must be >= 0 (or None: what the trainer's core affords), got {self.steps_per_request}")

    def learning(self) -> dict:
        """The learning settings (`LEARNING`) of this set-up: equal to DEFAULTS.learning() wherever nothing was overridden."""
        return {name: getattr(self, name) for name in LEARNING}

    def schedule(self, steps_per_request: float) -> tuple[StepSchedule, ShiftDetector | None]:
        """The replay trainer's step schedule at `steps_per_request` (with a derived rate: its learning-rate
        multiplier only), and the shift detector that warms it (None without `shift_detect`: a flat schedule)."""
        if not self.shift_detect:
            return StepSchedule(StepScheduleConfig(steps_per_request, steps_per_request, 1, 1.0)), None
        boost = max(self.boost_steps_per_request, steps_per_request)
        return (StepSchedule(StepScheduleConfig(steps_per_request, boost, self.boost_requests, self.boost_lr)),
                ShiftDetector(ShiftDetectorConfig(drop=self.shift_drop)))

    def loss(self, switches: dict, init: str = "scratch") -> FlywheelConfig:
        """The trainer's settings for a mode whose head starts as `init` ("static": a trained head, fine-tuned
        gently and anchored to itself; "scratch": a day-0 head)."""
        trained = init == "static"
        base = {"unroll": self.num_draft_tokens, "batch_size": self.batch_size, "lr": self.finetune_lr if trained else self.lr,
                "anchor": self.anchor if trained else 0.0, "publish_every": self.publish_every,
                "discard_weight": self.discard_weight, "branch_weight": self.branch_weight, "sample": self.sample,
                "recent_share": self.recent_share, "recent_window": self.recent_window, "pace_margin": self.pace_margin, "seed": self.seed,
                "covered_weight": self.covered_weight if self.prompt_lookup else 1.0}  # without the branch no position is covered
        return FlywheelConfig(**(base | switches))


DEFAULTS = FlywheelSetup()
# the fields that decide what and how fast the trainer learns (publish cadence, placement and drafting are per entry point)
LEARNING = ("batch_size", "lr", "finetune_lr", "anchor", "discard_weight", "branch_weight", "sample", "recent_share", "recent_window",
            "steps_per_request", "shift_detect", "boost_steps_per_request", "boost_requests", "boost_lr", "shift_drop", "pace_margin", "covered_weight")


def allowed_cores() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


START_CORES = frozenset(allowed_cores())  # the cores this process may use, read before any `pinned` block narrows them


def core_split(cores: set[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(serving cores, trainer cores) when the trainer can have a core of its own: the highest of `cores`
    (default: the ones this process was started with, also inside a `pinned` block) trains, the rest serve.
    None with fewer than 2 cores."""
    cores = sorted(START_CORES if cores is None else cores)
    return (tuple(cores[:-1]), tuple(cores[-1:])) if len(cores) >= 2 else None


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None):
    """Run the block on `cores` only (this process's threads started inside it inherit the mask); restore the
    old mask after. None: no change."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def trainer_process_pays() -> bool:
    """Whether live serving should train in a child process: with 2 cores or more the engine and the trainer
    each get one (a trainer thread would share the engine's interpreter lock); on 1 core they share it anyway."""
    return len(START_CORES) >= 2


def check_modes(modes) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise InvalidParameterError(f"unknown mode(s) {unknown}; available: {', '.join(MODES)}")


# ---- heads -------------------------------------------------------------------------------------------------------
def scratch_head(target, draft_vocab: int, seed: int = 0) -> EagleHead:
    """Day 0: an untrained head over the target's lowest draft_vocab ids (BPE's most common merges)."""
    config = EagleConfig.for_target(target.cfg, min(draft_vocab, target.cfg.vocab_size))
    vocab = draft_vocab_from_tokens([], config.draft_vocab_size, target.cfg.vocab_size)
    return new_eagle_head(target, config, vocab, torch.Generator().manual_seed(seed))


def train_static_head(target, traces: list[SequenceTrace], steps: int, draft_vocab: int, setup: FlywheelSetup) -> tuple[EagleHead, dict]:
    """A head trained offline on the served sequences of `traces` (their target states recomputed by one
    teacher-forced forward each: traces keep the target's distribution at generated positions only)."""
    from tandem.training.offline import TrainConfig, fit, step_function, target_example

    taps = EagleConfig.for_target(target.cfg).taps
    examples = [target_example(target, t.tokens.tolist(), t.prompt_len, taps) for t in traces]
    vocab = draft_vocab_from_tokens((e.tokens.tolist() for e in examples), min(draft_vocab, target.cfg.vocab_size), target.cfg.vocab_size)
    generator = torch.Generator().manual_seed(setup.seed)
    head = new_eagle_head(target, EagleConfig.for_target(target.cfg, len(vocab)), vocab, generator)
    train_cfg = TrainConfig(steps=steps, unroll=setup.num_draft_tokens, draft_vocab=draft_vocab, seed=setup.seed)
    start = time.perf_counter()
    losses = fit(head, step_function(train_cfg, head, target_lm_rows(target, head), generator), examples, train_cfg, generator)
    tail = losses[-10:]
    return head, {"steps": len(losses), "seconds": round(time.perf_counter() - start, 1), "loss_first": round(losses[0], 4),
                  "loss_last": round(sum(tail) / len(tail), 4)}


def serving_copy(head: EagleHead) -> EagleHead:
    """A frozen, prepacked copy to serve (the given head stays untouched: the trainer copies it again)."""
    served = trainer_copy(head).eval().requires_grad_(False)
    served.pack()
    return served


# ---- replay ------------------------------------------------------------------------------------------------------
class ServedHead:
    """What HotSwapper needs of a drafter in replay: the served head and its version."""

    def __init__(self, head: EagleHead):
        self.head, self.version = head, 0


class ReplayFlywheel:
    """A mode serving replayed requests; with loss switches, the flywheel learns between requests.

    The trainer's steps after each request: `setup.steps_per_request` when set (an explicit, reproducible rate),
    else what one trainer core affords (`CoreBudget`): the request's serving seconds, `serve_seconds(steps)` of
    the replayed steps (the calibrated cost model of tandem.bench.flywheel.shift), against the measured seconds of each
    trainer step."""

    def __init__(self, mode: str, target, heads: dict[str, EagleHead], setup: FlywheelSetup, serve_seconds: Callable[[list], float] | None = None):
        init, switches = MODES[mode]
        if init is None:
            raise InvalidParameterError(f"mode {mode!r} has no drafter to replay")
        if switches is not None and setup.steps_per_request is None and serve_seconds is None:
            raise InvalidParameterError("steps_per_request=None (what the trainer's core affords) needs serve_seconds, the cost of a replayed request")
        self.setup, self.serve_seconds = setup, serve_seconds
        self.served = serving_copy(heads[init])
        self.drafter = ServedHead(self.served)
        self.store, self.buffer = WeightStore(), TraceBuffer(policy="balance_domains")
        self.trainer: OnlineTrainer | None = None
        self.swapper: HotSwapper | None = None
        if switches is not None:
            self.trainer = OnlineTrainer(trainer_copy(heads[init]), target_lm_rows(target, heads[init]), self.buffer, self.store, setup.loss(switches, init))
            self.swapper = HotSwapper(self.drafter, self.store, collapse_ratio=setup.collapse_ratio, background=False)
            self.swapper.on_rollback = self.trainer.request_restore
        self.budget = CoreBudget() if setup.steps_per_request is None else None
        self.schedule, self.detector = setup.schedule(setup.steps_per_request or 0.0)
        self.trainer_seconds = 0.0  # wall time of the trainer steps taken so far (what a trainer core must afford)

    def serve(self, trace: SequenceTrace, max_tokens: int) -> tuple[ReplayResult, int]:
        """Replay one request under the current version; returns the result and the version that served it.
        With a trainer: the trace goes to the buffer, the detector sees its acceptance, and the trainer takes
        the steps the schedule (or the core's budget) gives, at the schedule's learning-rate multiplier."""
        version = self.drafter.version
        lookup = Lookup(k=self.setup.num_draft_tokens) if self.setup.prompt_lookup else None  # the deployed drafter, reported beside the chain
        result = replay_request(self.served, trace, self.setup.num_draft_tokens, max_tokens, lookup)
        if self.trainer is not None:
            self.buffer.put(replay_trace(trace, result, version))
            self.swapper.observe_lengths(version, [accepted + 1 for _, drafted, accepted in result.steps if drafted])
            if self.detector is not None and self.detector.observe(result.acceptance_length):
                self.schedule.shift()
            self.trainer.lr_scale = self.schedule.lr_scale()
            fixed = self.schedule.after_request()  # also runs the boost down
            if self.budget is None:
                for _ in range(fixed):
                    self._step()
            else:
                self._spend_budget(self.serve_seconds(result.steps))
            self.swapper()
        return result, version

    def _step(self) -> float | None:
        """One trainer step; its wall seconds, or None when it took none (nothing worth training on)."""
        begun = time.perf_counter()
        record = self.trainer.train_step()
        seconds = time.perf_counter() - begun
        self.trainer_seconds += seconds
        return None if record is None else seconds

    def _spend_budget(self, serve_s: float) -> None:
        self.budget.earn(serve_s)
        while self.budget.affords():
            seconds = self._step()
            if seconds is None:
                self.budget.idle()
                return
            self.budget.spend(seconds)

    def metrics(self) -> dict:
        if self.trainer is None:
            return {}
        shifts = self.detector.shifts if self.detector is not None else []
        return {"swaps": self.swapper.stats.as_dict(), "trainer_steps": self.trainer.steps, "buffer": asdict(self.buffer.stats()),
                "detected_shifts": shifts, "trainer_s": round(self.trainer_seconds, 1),
                "trainer_step_s": round(self.trainer_seconds / self.trainer.steps, 3) if self.trainer.steps else None}


# ---- live --------------------------------------------------------------------------------------------------------
def live_engine(mode: str, target, heads: dict[str, EagleHead], setup: FlywheelSetup, batch: int, max_len: int,
                record: bool = False) -> tuple[Engine, Flywheel | None]:
    """The engine for `mode` (plain: no drafter) and, for a training mode, its started Flywheel. A frozen mode
    (static, scratch) serves bare, as a user runs the head: no step records, no trace collector, no hot-swapper,
    so a comparison with it charges the flywheel for everything it adds. record=True gives a frozen mode a
    Flywheel that collects traces and never trains (`tandem bench trainer-step` records traces that way)."""
    init, switches = MODES[mode]
    if init is None:
        return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=max_len)), None
    drafter = EagleDrafter(serving_copy(heads[init]), setup.num_draft_tokens, batch, max_len, min_confidence=setup.min_confidence if init == "static" else 0.0)
    if setup.prompt_lookup:  # the flywheel still trains and swaps the head: the hybrid's head is the EagleDrafter's
        drafter = EagleNgramDrafter(drafter, NgramDrafter(num_draft_tokens=setup.num_draft_tokens))
    policy = None
    if setup.adaptive_k:
        from tandem.engine.control import SpeculationController

        policy = SpeculationController.for_engine(target, drafter, max_k=setup.num_draft_tokens)
    flywheel = switches is not None or record
    engine = Engine(target, EngineConfig(max_batch_size=batch, max_model_len=max_len, record_steps=flywheel), drafter=drafter, draft_policy=policy)
    return engine, Flywheel(engine, target, live_options(setup, init, switches)).start() if flywheel else None


def demo_setup(min_confidence: float, trainer_process: bool | None = None) -> FlywheelSetup:
    """DEFAULTS as `make demo` serves them live (and tandem.bench.flywheel.flywheel_costs measures them): the prompt-lookup
    graft, the head's confidence cut (`min_confidence`), the trainer on a core of its own (in a child process
    when the machine has >= 2 cores, unless `trainer_process` says), and a version every 5 trainer steps (a
    short run's learning reaches serving sooner); the learning settings are the defaults."""
    return replace(DEFAULTS, publish_every=5, prompt_lookup=True, min_confidence=min_confidence, trainer_core=True,
                   trainer_process=trainer_process_pays() if trainer_process is None else trainer_process)


def live_options(setup: FlywheelSetup, init: str, switches: dict | None = None, **storage) -> FlywheelOptions:
    """The Flywheel's options for a live mode: what `live_engine` (benchmarks, the demo) and `tandem serve --online`
    both run (one composition). init: "static" (a trained head: fine-tuned gently, anchored) or "scratch";
    switches: the loss switches (None: a frozen head); storage: spill / checkpoint / retention fields."""
    split = core_split() if setup.trainer_core and setup.trainer_process else None
    return FlywheelOptions(loss=setup.loss(switches or {}, init), train=switches is not None, collapse_ratio=setup.collapse_ratio, window=setup.watch_window,
                           trainer_duty=setup.trainer_duty, trainer_process=setup.trainer_process, trainer_cpus=split[1] if split else None, **storage)


def serving_cores(setup: FlywheelSetup) -> tuple[int, ...] | None:
    """The cores live serving runs on under `setup`: all but the trainer's with `trainer_core` (every mode,
    plain and static too, so a comparison gives each the same serving resources); None = no pinning."""
    split = core_split() if setup.trainer_core else None
    return split[0] if split else None


@dataclass
class StreamResult:
    rows: list[dict]  # per request, in stream order: i, domain, acceptance_length, tokens_per_s, version, steps (decode), drafted_per_step, draft_s / verify_s / prefill_s
    outputs: list[list[int]]  # output token ids per request, in stream order
    output_tokens: int
    seconds: float  # wall time of the whole stream

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def serve_stream(
    engine: Engine, flywheel: Flywheel | None, stream: list[tuple[list[int], str]], params: SamplingParams, batch: int,
    on_finish: Callable[[dict], None] | None = None, prefix: str = "req",
) -> StreamResult:
    """Serve (prompt ids, domain) pairs in order with `batch` requests in flight (a new one arrives when
    one finishes), stepping through the flywheel when there is one."""
    step = flywheel.step if flywheel is not None else engine.step
    pending = list(enumerate(stream))[::-1]
    by_id: dict[str, tuple[int, str]] = {}
    rows: list[dict] = []
    outputs: dict[int, list[int]] = {}
    output_tokens, start = 0, time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and engine.in_flight() < batch:
            i, (ids, domain) = pending.pop()
            by_id[engine.add_request(ids, params, request_id=f"{prefix}-{i}", tags={"domain": domain})] = (i, domain)
        requests = {r.request_id: r for r in itertools.chain(engine.waiting, engine.running)}
        for out in step():
            if out.finished:
                i, domain = by_id.pop(out.request_id)
                metrics = requests[out.request_id].metrics
                outputs[i] = list(requests[out.request_id].output_ids)
                output_tokens += metrics.output_tokens
                version = engine.drafter.version if engine.drafter is not None else 0
                rows.append({"i": i, "domain": domain, "acceptance_length": round(metrics.acceptance_length, 4),
                             "tokens_per_s": round(metrics.tokens_per_s, 3), "version": version, "steps": metrics.steps,
                             "drafted_per_step": round(metrics.drafted_tokens / metrics.steps, 3) if metrics.steps else 0.0,
                             "draft_s": round(metrics.draft_time_s, 4), "verify_s": round(metrics.verify_time_s, 4), "prefill_s": round(metrics.prefill_time_s, 4)})
                if on_finish is not None:
                    on_finish(rows[-1])
    seconds = time.perf_counter() - start
    rows.sort(key=lambda r: r["i"])
    return StreamResult(rows, [outputs[i] for i in sorted(outputs)], output_tokens, seconds)
