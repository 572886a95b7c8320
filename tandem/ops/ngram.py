"""Prompt lookup: continue the context the way it continued after an earlier occurrence of its suffix."""
from __future__ import annotations

import numpy as np


def ngram_propose(context: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:  # context: [L] int
    """Up to k tokens following the most recent earlier match of the longest suffix (n_max..n_min)."""
    length = len(context)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        start = _last_match(context, n)
        if start is not None:
            return context[start + n : start + n + k].tolist()
    return []


def _last_match(context: np.ndarray, n: int) -> int | None:
    """Start of the last earlier window equal to the final n tokens (the suffix itself excluded)."""
    suffix = context[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # [L-n, n]: starts 0..L-n-1
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else None


def ngram_candidates(context: np.ndarray, n_min: int, n_max: int, k: int, max_candidates: int) -> list[list[int]]:
    """Distinct continuations (up to k tokens) after earlier matches of the context's suffix.

    Longer suffix matches come first, and within one length the most recent match first: the order in
    which they are worth verifying.
    """
    length = len(context)
    found: list[list[int]] = []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        for start in np.flatnonzero((windows == context[-n:]).all(axis=1))[::-1]:
            continuation = context[start + n : start + n + k].tolist()
            if continuation and continuation not in found:
                found.append(continuation)
                if len(found) == max_candidates:
                    return found
    return found
