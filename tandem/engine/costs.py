"""The controller's cost model, kept true online: a roofline forward (calibrated or a prior) corrected by
what the engine measures, and the drafter's cost fitted from its measured times.

Forward: predict_total(B, N, C) = roofline(B, N / B, C) * scale(N) for a verify of N tokens over B rows (ragged:
each row its own 1 + draft; padded: B x the widest), where scale(N) is an EMA of measured / predicted over steps
that verified N tokens (nearest measured N when N was never run): the GEMMs' cost follows the tokens they run,
whatever the rows. predict(B, T, C) is the padded case, N = B x T. Without a
calibration the roofline is refitted from the engine's own timings once they span >= 4 token counts.
Drafter: seconds = fixed + per_depth * depth + per_node * nodes + per_sequence * B, ridge least squares pulled toward the
calibrated (or zero) cost, with exponential forgetting so it follows load changes.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from tandem.errors import InvalidParameterError
from tandem.sim.fit import Timing, fit_machine
from tandem.sim.roofline import Machine, ModelWork, forward_seconds
from tandem.sim.speculative import DraftCost

EMA = 0.2
REFIT_EVERY = 16  # steps between online refits (online-only mode)
FORGET = 0.97  # drafter fit: weight of an observation one step older
RIDGE = 1.0  # drafter fit: pull toward the prior, in units of one observation

# Without a model shape or calibration: one forward reads 1 unit of weights and computes 1 unit per
# token; the ridge of this CPU is a few tokens (RESOURCES.md), so compute time equals memory time at 4.
UNIT_WORK = ModelWork("unit", dense_params=0.5, bytes_per_param=2.0, kv_bytes_per_token=0.0, attn_flops_per_token_ctx=0.0)
UNIT_MACHINE = Machine("prior", bandwidth=1.0, peak_flops=4.0, source="prior: ridge at 4 tokens")


class ForwardCost:
    def __init__(self, work: ModelWork = UNIT_WORK, machine: Machine = UNIT_MACHINE, refit: bool = False):
        self.work, self.machine, self.refit = work, machine, refit
        self.scales: dict[int, float] = {}  # tokens verified N -> EMA of measured / predicted
        self.timings: deque[Timing] = deque(maxlen=256)
        self._since_refit = 0
        self._memo: dict[tuple[int, float, int], float] = {}  # predictions since the last observation (a plan asks many)

    def roofline(self, batch: int, tokens: int, context: int) -> float:
        return forward_seconds(self.work, self.machine, batch, tokens, context)

    def predict(self, batch: int, tokens: int, context: int) -> float:
        """Seconds of a forward of `batch` rows x `tokens` new tokens each."""
        return self.predict_total(batch, batch * tokens, context)

    def predict_total(self, batch: int, total: float, context: int) -> float:
        """Seconds of a forward of `total` new tokens over `batch` rows (any split among the rows)."""
        key = (batch, total, context)
        if key not in self._memo:
            self._memo[key] = self.roofline(batch, total / batch, context) * self.scale(round(total))
        return self._memo[key]

    def scale(self, tokens: int) -> float:
        if not self.scales:
            return 1.0
        if tokens in self.scales:
            return self.scales[tokens]
        nearest = min(self.scales, key=lambda t: (abs(t - tokens), t))
        return self.scales[nearest]

    def observe(self, batch: int, tokens: int, context: int, seconds: float) -> None:
        self.observe_total(batch, batch * tokens, context, seconds)

    def observe_total(self, batch: int, total: int, context: int, seconds: float) -> None:
        self._memo.clear()
        ratio = seconds / self.roofline(batch, total / batch, context)
        old = self.scales.get(total)
        self.scales[total] = ratio if old is None else math.exp((1 - EMA) * math.log(old) + EMA * math.log(ratio))
        self.timings.append(Timing(batch, total / batch, context, seconds))
        self._since_refit += 1
        if self.refit and self._since_refit >= REFIT_EVERY:
            self._refit()

    def _refit(self) -> None:
        """Fit the roofline to medians per (batch, tokens); the scales then restart near 1."""
        self._since_refit = 0
        groups: dict[tuple[int, int], list[Timing]] = {}
        for t in self.timings:
            groups.setdefault((t.batch, t.tokens), []).append(t)
        if len({b * t for b, t in groups}) < 4:
            return
        points = [sorted(g, key=lambda t: t.seconds)[len(g) // 2] for g in groups.values()]
        try:
            self.machine = fit_machine(self.work, points, name="online").machine
        except InvalidParameterError:  # e.g. step times flat in the tokens (no bandwidth term fits): keep the model and its scales
            return
        self.scales = {}


class DraftCostModel:
    def __init__(self, prior: DraftCost = DraftCost()):
        self.prior = np.array([prior.fixed_s, prior.per_depth_s, prior.per_node_s, prior.per_sequence_s])
        self.xtx = RIDGE * np.eye(4)
        self.xty = RIDGE * self.prior.copy()
        self.current = prior

    def observe(self, depth: int, nodes: int, sequences: int, seconds: float) -> None:
        if depth <= 0:
            return
        x = np.array(DraftCost.features(depth, nodes, sequences))
        self.xtx = FORGET * self.xtx + np.outer(x, x) + (1 - FORGET) * RIDGE * np.eye(4)
        self.xty = FORGET * self.xty + x * seconds + (1 - FORGET) * RIDGE * self.prior
        coef = np.clip(np.linalg.solve(self.xtx, self.xty), 0.0, None)
        self.current = DraftCost(*(float(c) for c in coef))

    def seconds(self, depth: int, nodes: int, sequences: int = 1) -> float:
        return self.current.seconds(depth, nodes, sequences)
