"""Server composition: load the model, build the engine (+ drafter, + flywheel), start the engine loop.

This is the only place that wires engine, flywheel and HTTP together (the engine and the trainer never
import each other). `Runtime.close()` stops the loop, then checkpoints the flywheel.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.config import SamplingParams
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.server.admin import DrafterControl
from tandem.server.engine_loop import EngineLoop
from tandem.server.metrics import ServerMetrics

DEFAULT_MAX_BODY = 1 << 20
MAX_AUTO_BATCH = 64  # the batch sized from the KV budget stops here (CPU steps grow with the batch: latency)
DAY = 86_400.0


@dataclass(frozen=True)
class ServerConfig:
    """What `tandem serve` runs."""

    model: str = "smollm2-135m"  # zoo name or local HF-format directory
    served_model_name: str | None = None  # the `model` clients send; None = the model argument
    drafter: str | None = None  # ngram | draft_model | self_draft | eagle | mtp; None = plain decoding
    drafter_path: str | None = None  # eagle/mtp: a trained head directory
    num_draft_tokens: int = 4  # the most a row drafts in a step (the deepest chain)
    adaptive_k: bool = True  # the speculation controller picks each step's draft shape (plain included) by tokens/s (a seeded
    # request's output does not depend on the shapes: tandem.ops.sampling.keyed_sample); False: always num_draft_tokens
    draft_vocab_size: int | None = None  # eagle day-0 head: draft vocabulary size (None = the drafter's default)
    online: bool = False  # the flywheel: collect traces, train the eagle head, hot-swap validated versions
    state_dir: str | None = None  # checkpoints, spilled traces, drafter versions (None: $TANDEM_HOME/serve/MODEL online, else temporary)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer key required on /v1 when set
    admin_key: str | None = None  # /admin routes exist only when set, and always require it
    max_batch_size: int | None = None  # None: as many rows as the KV-cache budget holds at max_model_len (<= 64)
    max_queue: int | None = None  # requests accepted beyond the running batch; more get 429 (None: 4 x max_batch_size)
    kv_cache_bytes: int | None = None  # KV budget sizing the default batch (None: a quarter of RAM, at most 8 GiB)
    request_timeout_s: float | None = 600.0  # a request still running after this is aborted: 408 (streams: an error event)
    queue_timeout_s: float | None = 60.0  # a request still queued after this is failed: 503 queue_timeout
    drain_timeout_s: float = 30.0  # SIGTERM/SIGINT: requests in flight get this long to finish (a second signal: at once)
    spill_traces: bool = True  # --online: also write traces to Parquet under state_dir/traces (restarts, offline training)
    spill_max_bytes: int | None = 2 << 30  # --online: spilled traces kept (the oldest shards are deleted beyond)
    spill_max_age_s: float | None = 7 * DAY  # --online: spilled shards older than this are deleted
    trainer_process: bool = False  # --online: train in a child process instead of a thread of the server
    json_logs: bool = False  # log JSON lines (with request ids) instead of text
    max_model_len: int | None = None  # KV cache per request (None = LLM's default)
    max_body_bytes: int = DEFAULT_MAX_BODY
    prefill_tokens_per_step: int = 512  # prompt tokens prefilled per engine step (a longer prompt in chunks: running requests never stall)
    threads: int | None = None  # the engine's torch threads (None: serving_threads(), one core left to the HTTP side)
    trainer_threads: int = 1
    publish_every: int | None = None  # online: trainer steps per published version (None = the flywheel default)
    checkpoint_every: int = 100  # online: trainer steps between checkpoints (and one at shutdown)

    def __post_init__(self) -> None:
        if self.online and self.drafter != "eagle":
            raise InvalidParameterError("--online trains an EAGLE head: use --drafter eagle")
        if not (1 <= self.port <= 65535 or self.port == 0):
            raise InvalidParameterError(f"port must be in [1, 65535], got {self.port}")
        if (self.max_queue is not None and self.max_queue < 0) or (self.max_batch_size is not None and self.max_batch_size < 1) or self.max_body_bytes < 1024:
            raise InvalidParameterError("max_queue must be >= 0, max_batch_size >= 1, max_body_bytes >= 1024")
        for name in ("request_timeout_s", "queue_timeout_s", "spill_max_age_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidParameterError(f"{name} must be > 0 (or None: no limit), got {value}")
        if self.drain_timeout_s < 0 or (self.spill_max_bytes is not None and self.spill_max_bytes < 0):
            raise InvalidParameterError("drain_timeout_s and spill_max_bytes must be >= 0")
        if self.trainer_process and not self.online:
            raise InvalidParameterError("--trainer-process needs --online")
        for name in ("api_key", "admin_key"):
            key = getattr(self, name)
            if key is not None and len(key) < 8:
                raise InvalidParameterError(f"{name} must be at least 8 characters")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def _state_dir(config: ServerConfig) -> tuple[Path, bool]:
    """(directory, temporary): --state-dir; else with --online a per-model directory under $TANDEM_HOME/serve
    (so a restart resumes); else a temporary directory removed on close."""
    if config.state_dir is not None:
        return Path(config.state_dir), False
    if config.online:
        from tandem.models.zoo import tandem_home

        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in config.model_name.strip("/"))
        return tandem_home() / "serve" / name, False
    return Path(tempfile.mkdtemp(prefix="tandem-serve-")), True


def kv_row_bytes(cfg, max_len: int, dtype_bytes: int = 4) -> int:
    """Bytes of one request's KV cache row (keys and values of every layer at max_len positions)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * max_len * dtype_bytes


def default_kv_budget() -> int:
    """A quarter of the machine's memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return min(8 << 30, total // 4)


def serving_threads() -> int:
    """The engine's threads when serving: every core but one from 4 cores up, so the HTTP event loop (parsing,
    detokenizing, writing responses) does not preempt one of the engine's OpenMP threads mid-step and stall the
    whole parallel region behind it (vLLM's CPU backend also asks to leave a core to its API server)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - 1 if cores >= 4 else cores


def sized_batch(cfg, max_len: int, budget: int, dtype_bytes: int = 4) -> int:
    """vLLM sizes its batch from the KV-cache memory budget: as many rows as fit, 1..MAX_AUTO_BATCH."""
    return max(1, min(MAX_AUTO_BATCH, budget // kv_row_bytes(cfg, max_len, dtype_bytes)))


def flywheel_setup(c: ServerConfig):
    """The flywheel's defaults (tandem.flywheel.setups.DEFAULTS: the learning settings every entry point shares),
    with the server's draft length, trainer placement and, when given, publish cadence."""
    from tandem.flywheel.setups import DEFAULTS

    return replace(DEFAULTS, num_draft_tokens=c.num_draft_tokens, trainer_process=c.trainer_process,
                   **({} if c.publish_every is None else {"publish_every": c.publish_every}))


def flywheel_options(c: ServerConfig, state_dir: Path):
    """The live flywheel as benchmarks compose it (flywheel.setups.live_options) from `flywheel_setup`: a trained
    head (--drafter-path) is fine-tuned at the defaults' finetune_lr, a day-0 head trained from scratch at their lr;
    traces spill under state_dir/traces with retention, or not at all."""
    from tandem.flywheel.setups import live_options

    spill = {"spill_dir": str(state_dir / "traces"), "spill_max_bytes": c.spill_max_bytes, "spill_max_age_s": c.spill_max_age_s} if c.spill_traces else {}
    return live_options(flywheel_setup(c), "static" if c.drafter_path else "scratch", {}, checkpoint_dir=str(state_dir / "checkpoint"),
                        trainer_threads=c.trainer_threads, checkpoint_every=c.checkpoint_every, **spill)


def _on_a_thread_that_ends(build, *args) -> None:
    """build(*args) on a thread of its own, joined (its exception raised here). The OpenMP team a thread starts lives
    until that thread ends; loading the model on the main thread left a team beside the engine loop's, and with more
    OpenMP threads than CPUs libgomp stops spinning: the loop's decode steps ran at PASSIVE's speed (19 vs 13 ms a step
    at 2 threads on a quiet Zen 5, docs/BENCHMARKS.md 12). Built here, the engine loop's thread is the process's only team."""
    import threading

    failure: list[BaseException] = []

    def run() -> None:
        try:
            build(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="tandem-build")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


class Runtime:
    """The served model: tokenizer + engine + loop (+ flywheel), and the metrics over them."""

    def __init__(self, config: ServerConfig):
        _on_a_thread_that_ends(self._build, config)
        if self.flywheel is not None:
            self.flywheel.start()
        self.loop.start()

    def _build(self, config: ServerConfig) -> None:
        from tandem.llm import LLM

        self.state_dir, self._temporary_state = _state_dir(config)
        self.llm = LLM(config.model, max_batch_size=config.max_batch_size or 1, max_model_len=config.max_model_len, num_threads=config.threads or serving_threads())
        if config.max_batch_size is None:
            cfg, max_len = self.llm.target.cfg, self.llm.config.max_model_len
            dtype_bytes = self.llm.target.embed.weight.element_size()
            config = replace(config, max_batch_size=sized_batch(cfg, max_len, config.kv_cache_bytes or default_kv_budget(), dtype_bytes))
        if config.max_queue is None:
            config = replace(config, max_queue=4 * config.max_batch_size)
        self.config = config
        self.llm.config = replace(self.llm.config, max_batch_size=config.max_batch_size)
        self.tokenizer = self.llm.tokenizer
        self.engine = self._engine()
        self.flywheel = self._flywheel() if config.online else None
        self.control = DrafterControl.build(self.engine, self.flywheel, self.state_dir / "versions")
        step = self.flywheel.step if self.flywheel is not None else None
        self.loop = EngineLoop(self.engine, step, config.max_queue, prefill_tokens_per_step=config.prefill_tokens_per_step,
                               queue_timeout_s=config.queue_timeout_s)
        self.metrics = ServerMetrics(self.engine, self.loop, self.control.swapper if self.control else None, self.flywheel, config.model_name)
        self.loop.on_finish = self.metrics.on_finish
        self.loop.on_tokens = self.metrics.on_tokens
        self.draining = False  # SIGTERM: readiness false, new requests 503, the ones in flight finish

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _engine(self) -> Engine:
        c, llm = self.config, self.llm
        drafter = None
        if c.drafter:
            from tandem.drafters import build_drafter

            extra = {"draft_vocab_size": c.draft_vocab_size} if c.draft_vocab_size else {}
            drafter = build_drafter(c.drafter, target=llm.target, num_draft_tokens=c.num_draft_tokens, drafter_path=c.drafter_path,
                                    device=llm.device, max_batch=llm.config.max_batch_size, max_len=llm.config.max_model_len, **extra)
        policy = None
        if drafter is not None and c.adaptive_k:  # at 16 rows every fixed draft ran 0.60-0.78x plain (docs/BENCHMARKS.md 14)
            from tandem.engine.control import SpeculationController

            policy = SpeculationController.for_engine(llm.target, drafter, model_name=c.model, max_k=c.num_draft_tokens)
        engine_config = replace(llm.config, record_steps=c.online, prefill_chunk_tokens=c.prefill_tokens_per_step)
        llm.engine = Engine(llm.target, engine_config, drafter=drafter, draft_policy=policy)
        return llm.engine

    def _flywheel(self):
        from tandem.flywheel.loop import Flywheel

        return Flywheel(self.engine, self.llm.target, flywheel_options(self.config, self.state_dir))

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.llm.apply_chat_template(messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)  # reads only model config and limits: safe off the engine thread

    @property
    def ready(self) -> bool:
        """Takes new requests: the loop is healthy and the server is not draining."""
        return self.loop.healthy and not self.draining

    def begin_drain(self) -> None:
        self.draining = True

    def close(self) -> None:
        self.loop.stop()
        if self.control is not None:
            self.control.close()
        if self.flywheel is not None:
            self.flywheel.close()  # checkpoints the trainer
        if self._temporary_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
