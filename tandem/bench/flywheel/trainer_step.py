"""`tandem bench trainer-step`: what one flywheel trainer step costs on live traces.

A head serves a short domain-shifting stream with trace recording on (a frozen flywheel: `live_engine`
"static" with record=True), then an `OnlineTrainer` over those traces times its steps, with the full loss and without the
branch term (the pass over drafted tokens off the accepted path, which only live traces carry). A trainer
step is the flywheel's unit of learning per served token: on a core of its own, serving time / step time
is how many steps a request can pay for.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tandem.bench.machine import machine_info
from tandem.config import SamplingParams
from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.setups import FlywheelSetup, live_engine, serve_stream
from tandem.flywheel.step_bytes import step_reads
from tandem.flywheel.stream import SPECIALISED, StreamSpec, build_stream, prompt_key
from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
from tandem.flywheel.weights import WeightStore


@dataclass(frozen=True)
class TrainerStepConfig:
    model: str = "smollm2-135m"
    head: str | None = None  # a head directory; None: the shipped head for the model
    requests: int = 12  # served to record traces
    domains: tuple[str, ...] = SPECIALISED
    max_tokens: int = 64
    batch: int = 4  # requests in flight while recording
    steps: int = 6  # timed trainer steps per loss (after one untimed warm-up step)
    batch_size: int = FlywheelSetup.batch_size  # traces per trainer step
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        if min(self.requests, self.max_tokens, self.batch, self.steps, self.batch_size) < 1 or not self.domains:
            raise InvalidParameterError("requests, max_tokens, batch, steps, batch_size >= 1 and some domains are required")


def recorded_traces(target, head, cfg: TrainerStepConfig, tokenizer) -> list:
    """The traces of `cfg.requests` stream requests served by `head` (frozen) with recording on."""
    spec = StreamSpec(requests=cfg.requests, block=max(1, cfg.requests // len(cfg.domains)), domains=cfg.domains, seed=cfg.seed)
    stream, ids, _ = build_stream(spec, tokenizer)
    longest = max(len(v) for v in ids.values()) + cfg.max_tokens + 1
    engine, flywheel = live_engine("static", target, {"static": head}, FlywheelSetup(seed=cfg.seed), cfg.batch, longest, record=True)
    serve_stream(engine, flywheel, [(ids[prompt_key(p)], p.domain) for p in stream], SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0), cfg.batch)
    flywheel.close()
    return flywheel.buffer.snapshot()


def time_steps(target, head, traces: list, loss: FlywheelConfig, steps: int) -> tuple[list[float], dict[str, int]]:
    """Wall seconds of `steps` trainer steps over `traces` (after one warm-up step), and the bytes one more step reads of
    the tensors the trainer keeps (tandem.flywheel.step_bytes: weights, target rows, optimiser moments)."""
    buffer = TraceBuffer()
    for trace in traces:
        buffer.put(trace)
    trainer = OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), buffer, WeightStore(), replace(loss, min_traces=1, warmup=1))
    trainer.train_step()
    seconds = [trainer.train_step()["seconds"] for _ in range(steps)]
    return seconds, step_reads(trainer)


def run_trainer_step_bench(cfg: TrainerStepConfig) -> dict:
    from tandem.llm import load_tokenizer
    from tandem.models.eagle import load_eagle, shipped_eagle_path
    from tandem.models.loader import load_transformer
    from tandem.models.zoo import resolve_model

    model_dir = Path(resolve_model(cfg.model))
    target = load_transformer(model_dir)
    target.pack()
    path = cfg.head or shipped_eagle_path(target.cfg)
    if path is None:
        raise InvalidParameterError(f"no shipped head for {cfg.model}: pass --head")
    head = load_eagle(path, target)
    began = time.perf_counter()
    traces = recorded_traces(target, head, cfg, load_tokenizer(model_dir))
    random.Random(cfg.seed).shuffle(traces)
    loss = FlywheelSetup(batch_size=cfg.batch_size, seed=cfg.seed).loss({}, "static")
    full, reads = time_steps(target, head, traces, loss, cfg.steps)
    timed = {"full": full, "no_branch": time_steps(target, head, traces, replace(loss, branch_weight=0.0), cfg.steps)[0]}
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {
        "config": asdict(cfg), "machine": machine_info(), "head": str(path), "traces": len(traces),
        "committed_per_trace": mean([len(t.features) for t in traces]), "branch_nodes_per_trace": mean([len(t.branch_token) for t in traces]),
        "step_s": {k: mean(v) for k, v in timed.items()}, "steps_s": timed, "seconds": round(time.perf_counter() - began, 1),
        "kept_mb_read_per_step": {k: round(v / 1e6, 1) for k, v in reads.items()} | {"total": round(sum(reads.values()) / 1e6, 1)},
    }


def add_bench_trainer_step_command(bench) -> None:
    d = TrainerStepConfig()
    p = bench.add_parser("trainer-step", help="the flywheel trainer's step time on live traces, with and without the branch term")
    p.add_argument("--model", default=d.model)
    p.add_argument("--head", default=None, help="an EAGLE head directory (default: the shipped head)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_bench_trainer_step)


def _bench_trainer_step(args) -> int:
    import json

    import torch

    torch.set_num_threads(args.threads)
    report = run_trainer_step_bench(TrainerStepConfig(model=args.model, head=args.head, requests=args.requests, max_tokens=args.max_tokens, steps=args.steps))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("head", "traces", "committed_per_trace", "branch_nodes_per_trace", "step_s", "kept_mb_read_per_step", "seconds")}, indent=1))
    return 0
