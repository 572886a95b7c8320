"""Offline training on the flywheel's spilled traces (`tandem train --data TRACES_DIR`).

The served requests' committed sequences (prompt + output) become offline-training `Example`s through
one teacher-forced target forward each (traces keep the target's distribution at generated positions
only, offline training reads it everywhere); the rest of the job (head, fit, evaluation, save) is
tandem.training.offline's. This lives in the flywheel
because it reads flywheel traces: training/ stays below flywheel/ in the layering.
"""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from tandem.errors import InvalidParameterError
from tandem.flywheel.buffer import load_traces
from tandem.training.offline import Example, TrainConfig, target_example, train_offline


def examples_from_traces(directory: str | Path, limit: int, target, taps: tuple[int, ...]) -> list[Example]:
    """Examples from the Parquet trace shards in `directory` (the newest `limit` traces, oldest first),
    the target's states recomputed over each whole sequence."""
    traces = [t for t in load_traces(directory, limit=limit, newest=True) if len(t.tokens) >= 3]
    return [target_example(target, t.tokens.tolist(), t.prompt_len, taps) for t in tqdm(traces, desc="trace features", disable=None)]


def train_from_traces(cfg: TrainConfig) -> dict:
    """`train_offline` with cfg.data a directory of trace shards (cfg.max_prompts traces at most)."""
    directory = Path(cfg.data).expanduser()
    if not directory.is_dir():
        raise InvalidParameterError(f"--data {cfg.data} is not a directory of trace shards")
    return train_offline(cfg, lambda target, taps: examples_from_traces(directory, cfg.max_prompts, target, taps))
