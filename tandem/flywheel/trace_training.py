"""Offline training on the flywheel's spilled traces (`tandem train --data TRACES_DIR`).

The served requests' own committed tokens and target states become offline-training `Example`s; the
rest of the job (head, fit, evaluation, save) is tandem.training.offline's. This lives in the flywheel
because it reads flywheel traces: training/ stays below flywheel/ in the layering.
"""
from __future__ import annotations

from pathlib import Path

from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import load_traces
from tandem.flywheel.trainer import trace_example
from tandem.training.offline import Example, TrainConfig, train_offline


def examples_from_traces(directory: str | Path, limit: int, taps: tuple[int, ...]) -> list[Example]:
    """Examples from the Parquet trace shards in `directory`: the newest `limit` traces, oldest first."""
    traces = load_traces(directory, limit=limit, newest=True)
    if taps and any(tuple(t.taps) != tuple(taps) for t in traces):
        raise InvalidParameterError(f"traces in {directory} were recorded with taps {traces[0].taps}; this head needs {taps}")
    return [trace_example(t) for t in traces if len(t.features) >= 2]


def train_from_traces(cfg: TrainConfig) -> dict:
    """`train_offline` with cfg.data a directory of trace shards (cfg.max_prompts traces at most)."""
    directory = Path(cfg.data).expanduser()
    if not directory.is_dir():
        raise InvalidParameterError(f"--data {cfg.data} is not a directory of trace shards")
    return train_offline(cfg, lambda target, taps: examples_from_traces(directory, cfg.max_prompts, taps))
