"""The controller's cost model, kept true online: a roofline forward (calibrated or a prior) refitted to what the
engine measures, and the drafter's cost fitted from its measured times.

Forward: predict_total(B, N, C) = roofline(B, N / B, C) x correction(B, N) x level, for a verify of N tokens over B
rows (ragged: each row its own 1 + draft; padded: B x the widest). Every REFIT_EVERY steps, from the engine's own
recent timings:
- the roofline (overhead + per token + max(memory, compute)) is refitted to the median timing per (rows, tokens) once
  >= 4 token counts have MIN_GROUP timings each, so its shape is this machine's (a quick calibration was 15-40 % high
  past the ridge on a Zen 5);
- correction(B, N) is the median measured / refitted time per (rows, tokens), its deviation from the rows' mean
  shrunk by SHRINK timings, interpolated between the token counts measured at these rows, and made monotone:
  what a roofline cannot draw (on a Zen 5 at batch 1, 1-2 tokens took 10 ms and 3-9 took 13.5), without the noise
  of one EMA per token count (which priced 4 tokens dearer than 8). Past the most tokens measured at these rows, the
  time grows from that count's as the prior roofline (the calibration's) grows: an engine that mostly decodes plain
  measures its forwards only below the ridge, and a roofline refitted to them has no compute roof (at 16 rows it
  priced a 90-token verify at 55 ms that took 82, and every verify shape looked like a win until tried);
- `level` restarts at 1 and follows measured / predicted between refits (load, drift).
predict(B, T, C) is the padded case, N = B x T.
Drafter: seconds = fixed + per_depth * depth + per_node * nodes + per_sequence * B, ridge least squares pulled toward the
calibrated (or zero) cost, with exponential forgetting so it follows load changes.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

from tandem.errors import InvalidParameterError
from tandem.ops.linalg import solve
from tandem.sim.fit import Timing, fit_machine
from tandem.sim.roofline import Machine, ModelWork, forward_seconds
from tandem.sim.speculative import DraftCost

LEVEL_EMA = 0.05  # per step, the level toward measured / predicted (in log): ~20 steps of memory
REFIT_EVERY = 32  # steps between online refits (after the first few, sooner)
MIN_GROUP = 3  # timings of one (rows, tokens) before its median joins a roofline refit
MAX_GROUPS = 24  # the most-measured groups a roofline refit uses (its cost grows with the groups)
SHRINK = 3.0  # timings of one (rows, tokens) that weigh as much as the rows' mean in its correction
FORGET = 0.97  # drafter fit: weight of an observation one step older
RIDGE = 1.0  # drafter fit: pull toward the prior, in units of one observation

# Without a model shape or calibration: one forward reads 1 unit of weights and computes 1 unit per
# token; the ridge of this CPU is a few tokens (RESOURCES.md), so compute time equals memory time at 4.
UNIT_WORK = ModelWork("unit", dense_params=0.5, bytes_per_param=2.0, kv_bytes_per_token=0.0, attn_flops_per_token_ctx=0.0)
UNIT_MACHINE = Machine("prior", bandwidth=1.0, peak_flops=4.0, source="prior: ridge at 4 tokens")


class ForwardCost:
    def __init__(self, work: ModelWork = UNIT_WORK, machine: Machine = UNIT_MACHINE, refit: bool = False):
        self.work, self.machine, self.refit = work, machine, refit
        self.prior = machine  # the calibrated (or preset) machine: how time grows past the token counts measured
        self.level = 1.0  # measured / predicted since the last refit (the mean until the first refit, then an EMA)
        self.corrections: dict[int, tuple[list[int], list[float], int]] = {}  # rows -> (token counts, monotone times, context)
        self.timings: deque[Timing] = deque(maxlen=256)
        self.refits = 0
        self._since_refit = 0
        self._memo: dict[tuple[int, float, int], float] = {}  # predictions since the last observation (a plan asks many)

    def roofline(self, batch: int, tokens: float, context: int) -> float:
        return forward_seconds(self.work, self.machine, batch, tokens, context)

    def predict(self, batch: int, tokens: int, context: int) -> float:
        """Seconds of a forward of `batch` rows x `tokens` new tokens each."""
        return self.predict_total(batch, batch * tokens, context)

    def predict_total(self, batch: int, total: float, context: int) -> float:
        """Seconds of a forward of `total` new tokens over `batch` rows (any split among the rows)."""
        key = (batch, total, context)
        if key not in self._memo:
            self._memo[key] = self._shape(batch, total, context) * self.level
        return self._memo[key]

    def correction(self, batch: int, total: float) -> float:
        """Measured / roofline at these rows and tokens (1 where nothing was measured at these rows): between measured
        token counts the times are interpolated (at the rows' median context); below them the smallest one's ratio;
        above them the largest one's time grown as the prior roofline grows."""
        if batch not in self.corrections:
            return 1.0
        totals, times, context = self.corrections[batch]
        i = bisect.bisect_left(totals, total)
        if i == len(totals):
            grown = forward_seconds(self.work, self.prior, batch, total / batch, context) / forward_seconds(self.work, self.prior, batch, totals[-1] / batch, context)
            return times[-1] * grown / self.roofline(batch, total / batch, context)
        if i == 0 and total < totals[0]:
            return times[0] / self.roofline(batch, totals[0] / batch, context)
        if totals[i] == total:
            seconds = times[i]
        else:
            lo, hi = totals[i - 1], totals[i]
            seconds = times[i - 1] + (times[i] - times[i - 1]) * (total - lo) / (hi - lo)
        return seconds / self.roofline(batch, total / batch, context)

    def observe(self, batch: int, tokens: int, context: int, seconds: float) -> None:
        self.observe_total(batch, batch * tokens, context, seconds)

    def observe_total(self, batch: int, total: int, context: int, seconds: float) -> None:
        self._memo.clear()
        ratio = seconds / self._shape(batch, total, context)
        self._since_refit += 1
        # before the first refit the level is the mean of the ratios measured (the prior can be 8x off: an
        # uncalibrated 1.5B priced a 31 ms plain step at 252 ms and kept drafting off for 8 steps), then an EMA
        weight = LEVEL_EMA if self.refits else max(LEVEL_EMA, 1.0 / self._since_refit)
        self.level = math.exp((1 - weight) * math.log(self.level) + weight * math.log(max(ratio, 1e-6)))
        self.timings.append(Timing(batch, total / batch, context, seconds))
        if self.refit and self._since_refit >= min(REFIT_EVERY, 8 * (self.refits + 1)):  # the first refits sooner: 8, 16, 24, 32, then every 32
            self._refit()

    def _shape(self, batch: int, total: float, context: int) -> float:
        return self.roofline(batch, total / batch, context) * self.correction(batch, total)

    def _refit(self) -> None:
        """The roofline from the median timing per (rows, tokens) of the most-measured groups (kept as it is when too
        few groups, or timings no roofline fits: flat in the tokens), then the corrections against it; the level
        restarts at 1."""
        self._since_refit = 0
        groups: dict[tuple[int, int], list[Timing]] = {}
        for t in self.timings:
            groups.setdefault((t.batch, round(t.batch * t.tokens)), []).append(t)
        measured = sorted(((key, g) for key, g in groups.items() if len(g) >= MIN_GROUP), key=lambda kg: len(kg[1]), reverse=True)[:MAX_GROUPS]
        roofline_due = self.refits < 4 or self.refits % 4 == 0  # a fit costs ~10 ms at 24 groups: every 4th refit after the first 4
        if roofline_due and len({total for (_, total), _ in measured}) >= 4:
            try:
                self.machine = fit_machine(self.work, [_median_timing(g) for _, g in measured], name="online").machine
            except InvalidParameterError:
                pass
        self.corrections = self._corrections(groups)
        self.level, self.refits = 1.0, self.refits + 1
        self._memo.clear()

    def _corrections(self, groups: dict[tuple[int, int], list[Timing]]) -> dict[int, tuple[list[int], list[float], int]]:
        """Per rows: the median measured / roofline per token count, its deviation from the rows' mean ratio shrunk by
        SHRINK timings (a count seen twice moves little), as times at the rows' median context, then their running
        maximum (monotone)."""
        by_rows: dict[int, dict[int, list[Timing]]] = {}
        for (batch, total), g in groups.items():
            by_rows.setdefault(batch, {})[total] = g
        out = {}
        for batch, per_total in by_rows.items():
            context = round(statistics.median(t.context for g in per_total.values() for t in g))
            totals = sorted(per_total)
            logs = [math.log(statistics.median(t.seconds / self.roofline(t.batch, t.tokens, t.context) for t in per_total[n])) for n in totals]
            counts = [len(per_total[n]) for n in totals]
            mean = sum(c * x for c, x in zip(counts, logs)) / sum(counts)
            times, floor = [], 0.0
            for total, x, count in zip(totals, logs, counts):
                floor = max(floor, self.roofline(batch, total / batch, context) * math.exp(mean + count / (count + SHRINK) * (x - mean)))
                times.append(floor)  # more tokens never cost less
            out[batch] = (totals, times, context)
        return out


def _median_timing(group: list[Timing]) -> Timing:
    first = group[0]
    return Timing(first.batch, first.tokens, round(statistics.median(t.context for t in group)), statistics.median(t.seconds for t in group))


class DraftCostModel:
    """Plain Python floats, not numpy: the model is updated once a step right after a forward has streamed the weights
    through the caches, where each numpy call's code came back from memory (~150 us a step against ~15 us warm)."""

    def __init__(self, prior: DraftCost = DraftCost()):
        self.prior = [prior.fixed_s, prior.per_depth_s, prior.per_node_s, prior.per_sequence_s]
        self.xtx = [[RIDGE if i == j else 0.0 for j in range(4)] for i in range(4)]
        self.xty = [RIDGE * p for p in self.prior]
        self.current = prior

    def observe(self, depth: int, nodes: int, sequences: int, seconds: float) -> None:
        if depth <= 0:
            return
        x = DraftCost.features(depth, nodes, sequences)
        pull = (1 - FORGET) * RIDGE
        for i in range(4):
            row = self.xtx[i]
            for j in range(4):
                row[j] = FORGET * row[j] + x[i] * x[j] + (pull if i == j else 0.0)
            self.xty[i] = FORGET * self.xty[i] + x[i] * seconds + pull * self.prior[i]
        self.current = DraftCost(*(max(c, 0.0) for c in solve(self.xtx, self.xty)))

    def seconds(self, depth: int, nodes: int, sequences: int = 1) -> float:
        return self.current.seconds(depth, nodes, sequences)
