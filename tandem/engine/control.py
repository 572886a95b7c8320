"""Adaptive draft length: per request, pick k from measured acceptance and measured draft/verify costs.

Acceptance per draft position is an EMA per request (seeded from the engine-wide EMA); costs are EMAs
of what the engine measured (draft ms per drafted token, verify ms per draft length). When speculation
does not pay (k = 0) the request still probes with a short draft now and then, so it can come back;
probes are spaced so they cost at most 5 % of plain decoding (rarer for expensive drafters).
"""
from __future__ import annotations

import math

from tandem.ops.cost import best_draft_length

PROBE_K = 2  # draft length of a probe while speculation is off
PROBE_BUDGET = 0.05  # probes may cost at most this fraction of plain decoding time


class AdaptiveDraftLength:
    def __init__(self, max_k: int, ema: float = 0.25, prior_acceptance: float = 0.6, verify_slope_prior: float = 0.1, probe_every: int = 8):
        self.max_k = max_k
        self.ema = ema
        self.global_alphas = [prior_acceptance] * max_k
        self.alphas: dict[str, list[float]] = {}
        self.verify_ms: list[float | None] = [None] * (max_k + 1)
        self.draft_ms_per_token: float | None = None
        self.slope = verify_slope_prior
        self.probe_every = probe_every
        self.idle_steps: dict[str, int] = {}

    def choose_k(self, request) -> int:
        alphas = self.alphas.get(request.request_id, self.global_alphas)
        k = best_draft_length(alphas, self.draft_ms_per_token or 0.0, self._verify_costs())
        if k == 0:
            idle = self.idle_steps.get(request.request_id, 0) + 1
            self.idle_steps[request.request_id] = idle
            if idle % self._probe_interval() == 0:
                return min(PROBE_K, self.max_k)
        return k

    def _probe_interval(self) -> int:
        """Idle steps between probes, so that probing costs at most PROBE_BUDGET of plain decoding time."""
        costs = self._verify_costs()
        probe_ms = PROBE_K * (self.draft_ms_per_token or 0.0) + costs[min(PROBE_K, self.max_k)] - costs[0]
        return max(self.probe_every, math.ceil(probe_ms / (PROBE_BUDGET * costs[0])))

    def observe(self, requests, drafts, results, draft_s: float, verify_s: float) -> None:
        width = max(len(d) for d in drafts)
        self.verify_ms[min(width, self.max_k)] = self._blend(self.verify_ms[min(width, self.max_k)], verify_s * 1000)
        drafted = sum(len(d) for d in drafts)
        if drafted:
            self.draft_ms_per_token = self._blend(self.draft_ms_per_token, draft_s * 1000 / drafted)
        for request, draft, result in zip(requests, drafts, results):
            if len(draft):
                mine = self.alphas.setdefault(request.request_id, list(self.global_alphas))
                self._update(mine, len(draft), result.num_accepted)
                self._update(self.global_alphas, len(draft), result.num_accepted)

    def release(self, request) -> None:
        self.alphas.pop(request.request_id, None)
        self.idle_steps.pop(request.request_id, None)

    def _update(self, alphas: list[float], k: int, accepted: int) -> None:
        for j in range(min(k, accepted + 1, self.max_k)):  # positions up to the first rejection were observed
            alphas[j] = self._blend(alphas[j], 1.0 if j < accepted else 0.0)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def _verify_costs(self) -> list[float]:
        """Measured verify ms per k; unmeasured k extrapolated from the nearest measured one (prior slope)."""
        known = [(k, ms) for k, ms in enumerate(self.verify_ms) if ms is not None]
        if not known:
            return [1.0 + self.slope * k for k in range(self.max_k + 1)]
        costs = []
        for k, ms in enumerate(self.verify_ms):
            if ms is None:
                near_k, near_ms = min(known, key=lambda kv: abs(kv[0] - k))
                ms = near_ms * (1 + self.slope * k) / (1 + self.slope * near_k)
            costs.append(ms)
        return costs
