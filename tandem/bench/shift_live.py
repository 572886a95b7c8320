"""`tandem bench shift` without --replay: the live engine serves the stream, the trainer runs beside it.

Each mode serves the same stream with `live_batch` requests in flight (a new one arrives when one
finishes). The engine runs with 1 torch thread and the trainer thread with 1, in every mode (static
included), so serving gets the same CPU share whether or not a trainer is running.
"""
from __future__ import annotations

import itertools

import torch
from tqdm import tqdm

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters.eagle import EagleDrafter
from tandem.engine.engine import Engine
from tandem.flywheel.loop import Flywheel, FlywheelOptions


def live_mode(mode: str, target, stream, stream_ids: dict[str, list[int]], heads: dict, cfg, on_finish=None) -> tuple[list[dict], dict]:
    """Serve the stream under `mode`; on_finish(row, flywheel) is called as each request finishes."""
    from tandem.bench.shift import MODES, _key, _serving, flywheel_config

    init, switches = MODES[mode]
    torch.set_num_threads(1)
    longest = max(len(ids) for ids in stream_ids.values()) + cfg.max_tokens + 1
    drafter = EagleDrafter(_serving(heads[init]), cfg.num_draft_tokens, cfg.live_batch, longest)
    engine = Engine(target, EngineConfig(max_batch_size=cfg.live_batch, max_model_len=longest, record_steps=True), drafter=drafter)
    options = FlywheelOptions(loss=flywheel_config(cfg, switches or {}), train=switches is not None, collapse_ratio=cfg.collapse_ratio)
    flywheel = Flywheel(engine, target, options).start()
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)
    rows: list[dict] = []
    pending = list(enumerate(stream))[::-1]
    by_id: dict[str, tuple[int, object]] = {}
    with tqdm(total=len(stream), desc=f"{mode} (live)", unit="req", disable=True if on_finish else None) as bar:
        while pending or engine.has_unfinished():
            while pending and len(engine.waiting) + len(engine.running) < cfg.live_batch:
                i, prompt = pending.pop()
                request_id = engine.add_request(stream_ids[_key(prompt)], params, request_id=f"{mode}-{i}", tags={"domain": prompt.domain})
                by_id[request_id] = (i, prompt)
            requests = {r.request_id: r for r in itertools.chain(engine.waiting, engine.running)}
            for out in flywheel.step():
                if out.finished:
                    i, prompt = by_id.pop(out.request_id)
                    metrics = requests[out.request_id].metrics if out.request_id in requests else None
                    rows.append(_row(i, prompt.domain, metrics, drafter.version))
                    bar.update(1)
                    if on_finish is not None:
                        on_finish(rows[-1], flywheel)
    flywheel.close()
    rows.sort(key=lambda r: r["i"])
    return rows, flywheel.metrics()


def _row(i: int, domain: str, metrics, version: int) -> dict:
    return {"i": i, "domain": domain, "acceptance_length": round(metrics.acceptance_length, 4) if metrics else 0.0,
            "tokens_per_s": round(metrics.tokens_per_s, 3) if metrics else 0.0, "version": version}
