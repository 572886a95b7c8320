"""Calibration: measure the target's forward cost over (batch, tokens per sequence, context), the
drafter's cost per step, memory bandwidth and matmul throughput on this machine; fit the roofline
(tandem.sim.fit); store the record per model + machine fingerprint under $TANDEM_HOME/calibration.

The controller (tandem.engine.control) loads the record at start through `resolve_calibration`. Drafters are built
by the caller (composition lives above the engine: tandem.llm builds `tandem calibrate`'s and the served drafter's
factories); this module only measures what it is given.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm
from tandem.models.kv_cache import KVCache
from tandem.models.zoo import tandem_home
from tandem.sim.calibration import Calibration, load_calibration, save_calibration
from tandem.sim.fit import Timing, fit_machine, measured_rates_report, nonneg_least_squares
from tandem.sim.roofline import work_from_config
from tandem.sim.speculative import DraftCost

if TYPE_CHECKING:  # the type only: drafters are built by the caller
    from tandem.drafters.base import Drafter


@dataclass(frozen=True)
class CalibrationGrid:
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    reps: int
    draft_ks: tuple[int, ...]
    draft_batches: tuple[int, ...]

    @staticmethod
    def for_mode(quick: bool) -> "CalibrationGrid":
        if quick:  # ~10 s for SmolLM2 on 2 idle cores
            return CalibrationGrid((1, 4, 8), (1, 3, 6), (64,), 3, (1, 3), (1, 4))
        return CalibrationGrid((1, 2, 4, 8, 16), (1, 2, 3, 5, 8), (32, 256), 5, (1, 2, 3, 4), (1, 4, 16))


MEASURE_MAX_LEN = 256  # the measuring engine's max_model_len (prompts of 72 tokens + the drafted steps)
DRAFTER_MAX_LEN = 512  # a measured drafter's own length, above the measuring engine's
FULL_CHAINS = 0.0  # draft cost is measured on full chains (an EAGLE head's confidence cut would end most of them on the
# random prompts); drafters without the option ignore it, as they ignore tree options


def measure_options() -> dict:
    """What a drafter factory given to `calibrate` must build with, on top of the drafter's own options: room for the
    widest grid batch and the measuring engine's length, and full chains."""
    return {"max_batch": max(CalibrationGrid.for_mode(False).draft_batches), "max_len": DRAFTER_MAX_LEN,
            "min_confidence": FULL_CHAINS}


def fingerprint() -> dict:
    """What makes timings from one machine invalid on another, and from one build of the CPU kernels on the next (a
    kernel change moves the costs: stop 30's int8 kernel made self_draft's drafting ~2x cheaper at 4-16 rows, and a
    record from before it would price it at the old cost)."""
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    kernels = f"small_gemm-{cpu_gemm.kernel_key()}"  # the kernels' sources, torch version and flags (nothing is built here)
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "kernels": kernels}


def calibration_path(model_name: str, fp: dict | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(fp or fingerprint(), sort_keys=True).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return tandem_home() / "calibration" / f"{safe}-{digest}.json"


# ---- measurement --------------------------------------------------------------------------------------
@torch.inference_mode()
def measure_forward(model, grid: CalibrationGrid, seed: int = 0) -> list[Timing]:
    """Median seconds of one cached forward of B x T new tokens after C context tokens, over the grid."""
    gen = torch.Generator().manual_seed(seed)
    device = model.embed.weight.device
    timings = []
    for context in grid.contexts:
        cache = KVCache(model.cfg, max(grid.batches), context + max(grid.tokens) + 1, model.embed.weight.dtype, device)
        model(torch.randint(0, model.cfg.vocab_size, (max(grid.batches), context), generator=gen).to(device), cache=cache)
        for batch in grid.batches:
            for tokens in grid.tokens:
                ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=gen).to(device)
                times = []
                for _ in range(grid.reps + 1):
                    t = time.perf_counter()
                    model(ids, cache=cache, rows=slice(0, batch))
                    times.append(time.perf_counter() - t)
                    cache.lengths[:batch] = context
                timings.append(Timing(batch, tokens, context, min(times[1:])))  # min: the least disturbed by other jobs
    return timings


class _FixedBudget:
    """A draft_policy that drafts `budget` nodes every step and records the drafter's time."""

    def __init__(self, budget: int):
        self.budget, self.samples = budget, []

    def plan(self, requests) -> list[int]:
        return [self.budget] * len(requests)

    def choose_k(self, request) -> int:
        return self.budget

    def observe(self, requests, drafts, results, draft_s: float, verify_s: float, verified_tokens: int | None = None) -> None:
        depth = max((len(d.nodes_per_depth()) for d in drafts), default=0)
        self.samples.append((depth, sum(len(d) for d in drafts), len(drafts), draft_s))

    def release(self, request) -> None:
        pass


def measure_drafter(model, drafter_factory, grid: CalibrationGrid, steps: int = 6, seed: int = 0) -> list[tuple[int, int, int, float]]:
    """(depth, nodes, sequences, draft seconds) per engine step with a fixed budget; prompts repeat a random
    sequence over a few token ids so that lookup drafters find matches too."""
    from tandem.engine.engine import Engine

    gen = torch.Generator().manual_seed(seed)
    drafter = drafter_factory()  # built once (self_draft quantizes the whole target)
    samples = []
    for batch in grid.draft_batches:
        for k in grid.draft_ks:
            policy = _FixedBudget(k)
            engine = Engine(model, EngineConfig(max_batch_size=batch, max_model_len=MEASURE_MAX_LEN), drafter=drafter, draft_policy=policy)
            prompts = [torch.randint(0, 8, (24,), generator=gen).tolist() * 3 for _ in range(batch)]  # 8 ids: lookups match
            engine.run(prompts, [SamplingParams(max_tokens=steps * (k + 1), temperature=0.0, ignore_eos=True)] * batch)
            samples += [s for s in policy.samples[1:] if s[0] > 0]  # the first step warms the drafter up
    return samples


def fit_draft_cost(samples: list[tuple[int, int, int, float]]) -> DraftCost:
    """(depth, nodes, sequences, seconds) samples -> DraftCost, by non-negative least squares over the
    lower quartile per (depth, nodes, sequences): steps slowed down by other jobs would otherwise dominate."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for d, n, b, s in samples:
        groups.setdefault((d, n, b), []).append(s)
    if not samples:
        raise InvalidParameterError("no drafter timings (the drafter never drafted)")
    design = np.array([DraftCost.features(d, n, b) for d, n, b in groups])
    y = np.array([sorted(v)[len(v) // 4] for v in groups.values()])
    coef = nonneg_least_squares(design, y)
    return DraftCost(*(float(c) for c in coef)) if coef is not None else DraftCost()


def measure_bandwidth(size_mb: int = 256, reps: int = 5) -> float:
    """Bytes/s of a matrix-vector product over a buffer far larger than the caches (what decoding does)."""
    x = torch.ones(size_mb * 1024 * 1024 // 4).view(-1, 4096)
    v = torch.ones(4096)
    torch.mv(x, v)
    best = min(_timed(lambda: torch.mv(x, v)) for _ in range(reps))
    return x.numel() * 4 / best


def measure_matmul_flops(n: int = 1024, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return 2 * n**3 / min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def calibrate(model, model_name: str, factories: dict[str, Callable[[], Drafter]] | None = None, quick: bool = False,
              grid: CalibrationGrid | None = None) -> Calibration:
    """Measure and fit. factories: drafter name -> the caller's factory building that drafter over `model` (with
    measure_options()); this layer builds none itself."""
    grid = grid or CalibrationGrid.for_mode(quick)
    started = time.perf_counter()
    work = work_from_config(model.cfg, model_name, bytes_per_param=model.embed.weight.element_size(),
                            kv_bytes=model.embed.weight.element_size())
    timings = measure_forward(model, grid)
    label = f"{model_name} on {platform.node() or 'this machine'}"
    bandwidth, flops = measure_bandwidth(64 if quick else 256), measure_matmul_flops(512 if quick else 1024)
    try:
        report = fit_machine(work, timings, name=label)
    except InvalidParameterError:  # times flat in the tokens (a tiny model: overhead only): the machine's measured rates
        report = measured_rates_report(work, timings, bandwidth, flops, name=label)
    fitted = {name: fit_draft_cost(measure_drafter(model, factory, grid)) for name, factory in (factories or {}).items()}
    measured = {
        "bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops,
        "fit_rms_rel_error": report.rms_rel_error, "fit_max_rel_error": report.max_rel_error,
        "timings": [vars(t) for t in timings], "quick": quick, "seconds": 0.0,
    }
    measured["seconds"] = time.perf_counter() - started
    return Calibration(model_name, fingerprint(), work, report.machine, fitted, measured, created=time.time())


# ---- the controller's entry ---------------------------------------------------------------------------
def resolve_calibration(model, drafter, calibration, model_name: str | None, recalibrate: bool,
                        drafter_factory: Callable[[], Drafter] | None = None) -> Calibration | None:
    """The calibration to use, or None (online-measured model) with a message saying why. With `recalibrate`, a
    missing or stale record (or, given drafter_factory, one without `drafter`'s cost) is measured now (quick) and
    stored: the target, and the drafter built by `drafter_factory` (the caller's: it knows the drafter's options;
    see measure_options). Without a factory only the target is measured and the drafter's cost is learnt online."""
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is not None:
        return load_calibration(calibration)
    if model_name is None:
        return None
    path = calibration_path(model_name)
    record, reason = _stored(path, drafter, recalibrate and drafter_factory is not None)
    if record is not None:
        return record
    if recalibrate:
        print(f"tandem: calibration for {model_name} {reason}: measuring now (quick)", file=sys.stderr)
        record = calibrate(model, model_name, _recalibration_factories(drafter, drafter_factory), quick=True)
        save_calibration(record, path)
        return record
    print(f"tandem: no fresh calibration for {model_name} ({reason}); using an online-measured cost model. "
          f"Run `tandem calibrate --model {model_name}` for a calibrated one.", file=sys.stderr)
    return None


def _stored(path: Path, drafter, need_drafter: bool) -> tuple[Calibration | None, str]:
    """The stored record if fresh (and holding `drafter`'s cost when need_drafter), else None and why not."""
    if not path.exists():
        return None, "missing"
    record = load_calibration(path)
    reason = record.stale_reason(fingerprint())
    if reason is not None:
        return None, reason
    if need_drafter and drafter is not None and drafter.name not in record.drafters:
        return None, f"has no cost for drafter {drafter.name}"
    return record, ""


def _recalibration_factories(drafter, drafter_factory) -> dict:
    if drafter is None:
        return {}
    if drafter_factory is None:
        print(f"tandem: no drafter factory given: calibrating the target only ({drafter.name}'s cost is measured online)",
              file=sys.stderr)
        return {}
    return {drafter.name: drafter_factory}
