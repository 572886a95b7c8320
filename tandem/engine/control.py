"""The speculation controller: each step, predict the batch's throughput for plain decoding and for every
draft size, and speculate only where it pays (the engine's `draft_policy`).

Per step (`plan`, called once by Engine._propose): the batch of B requests at mean context C drafts
budget n (0 = plain) each; the target verifies B x (1 + n) tokens (the engine pads every row to the
widest draft, so that is the forward it pays for), the drafter costs draft(depth(n), B * n), and request
r emits E_r(n) = 1 + sum_d prod_{j<=d} a_r,j tokens, with a_r,j its live acceptance per depth. The plan
is the n with the highest sum_r E_r(n) / (draft + forward(B, 1 + n, C)). Costs come from the calibrated
roofline, corrected online (tandem.engine.costs); acceptance is an EMA per request seeded from the
engine-wide one; a depth not drafted drifts toward the one above it (never-measured ones start there).
Hysteresis: speculation turns on when predicted >= (1 + ON_MARGIN) x plain and off when
< (1 - OFF_MARGIN) x plain, each for PATIENCE steps in a row, or at once when the prediction is
DECISIVE beyond 1 (the live batch moved: a rollout batch starting at 32 rows, its tail at 1). It
starts on (an optimistic prior), so a drafter that pays is never judged on a prior alone; while off
it probes, spaced so that probing costs at most PROBE_BUDGET of plain decoding time, and MAX_BACKOFF
times further apart where not even a perfect draft would pay at this batch. Trees: the budget is a
node count; the depth a budget reaches is learnt from the drafts the drafter returned.
"""
from __future__ import annotations

import math
from dataclasses import asdict

from tandem.engine.costs import DraftCostModel, ForwardCost
from tandem.ops.cost import expected_tokens_per_step

ON_MARGIN = 0.05
OFF_MARGIN = 0.02
PATIENCE = 3
DECISIVE = 0.15  # a prediction this far beyond 1 switches at once
PROBE_BUDGET = 0.05
PRIOR_ACCEPTANCE = 0.8
MAX_BACKOFF = 8
RELAX = 0.02  # per step: an undrafted depth's acceptance drifts toward the depth above it


class SpeculationController:
    def __init__(self, max_k: int, forward: ForwardCost | None = None, draft: DraftCostModel | None = None,
                 max_nodes: int | None = None, ema: float = 0.25, prior_acceptance: float = PRIOR_ACCEPTANCE):
        self.max_k = max_k  # deepest draft
        self.max_nodes = max_nodes or max_k  # largest budget (> max_k for tree drafters)
        self.forward = forward or ForwardCost(refit=True)
        self.draft = draft or DraftCostModel()
        self.ema = ema
        self.global_alphas = [prior_acceptance] * max_k
        self.alphas: dict[str, list[float]] = {}
        self.measured_depth = 0  # how many depths (engine-wide) have had their acceptance measured at least once
        self.depth_of: dict[int, float] = {}  # budget -> EMA of the depth the drafter reached
        self.on, self._streak, self._idle, self._backoff = True, 0, 0, 1
        self._plan: dict[str, int] = {}
        self._drafted_last: dict[str, bool] = {}  # request -> did its previous step draft
        self.fill = 1.0  # EMA: fraction of requests that got a non-empty draft when the budget was > 0
        self._pending: tuple[int, float, float] | None = None  # (budget, predicted speedup, plain seconds)
        self.stats = {"steps": 0, "speculative_steps": 0, "probes": 0, "switches": 0, "plain_equiv_s": 0.0, "actual_s": 0.0,
                      "predicted_sum": 0.0, "realised_sum": 0.0, "budget_hist": {}, "last": {}}

    @classmethod
    def for_engine(cls, model, drafter, calibration=None, model_name: str | None = None, recalibrate: bool = False,
                   max_k: int | None = None, drafter_factory=None) -> "SpeculationController":
        """A controller for this target + drafter: calibration = a Calibration, a JSON path, or None
        (look up $TANDEM_HOME's record for model_name on this machine; re-measure it when missing or
        stale if `recalibrate`, else fall back to an online-measured model and say so). drafter_factory:
        the caller's builder of a drafter like `drafter` (same options), used only to measure its cost when
        recalibrating (engine.calibrate.resolve_calibration); without it only the target is re-measured."""
        from tandem.engine.calibrate import resolve_calibration
        from tandem.sim.roofline import work_from_config

        k = max_k or drafter.max_nodes
        calib = resolve_calibration(model, drafter, calibration, model_name, recalibrate, drafter_factory)
        if calib is None:
            forward = ForwardCost(work_from_config(model.cfg, model_name or "target"), _prior_machine(), refit=True)
            return cls(k, forward, DraftCostModel(), max_nodes=drafter.max_nodes)
        prior = calib.drafters.get(drafter.name)
        return cls(k, ForwardCost(calib.work, calib.machine), DraftCostModel(prior) if prior else DraftCostModel(),
                   max_nodes=drafter.max_nodes)

    # ---- the engine's draft_policy interface ---------------------------------------------------------
    def plan(self, requests) -> list[int]:
        """Draft budget per request for this step (one decision for the whole batch)."""
        batch = len(requests)
        context = round(sum(len(r.all_ids) for r in requests) / batch)
        steps = [self._step(requests, n, context) for n in range(self.max_nodes + 1)]  # (tokens, seconds)
        rates = [tokens / seconds for tokens, seconds in steps]
        best = max(range(1, len(rates)), key=lambda n: (rates[n], -n))  # the best speculative budget
        budget = self._decide(best, rates[best] / rates[0], steps, lambda: self._could_pay(requests, context, rates[0]))
        self._plan = {r.request_id: min(budget, _remaining(r)) for r in requests}
        self._pending = (budget, rates[budget] / rates[0], self.forward.predict(batch, 1, context))
        return [self._plan[r.request_id] for r in requests]

    def choose_k(self, request) -> int:
        if request.request_id not in self._plan:
            self.plan([request])
        return self._plan.pop(request.request_id)

    def observe(self, requests, drafts, results, draft_s: float, verify_s: float) -> None:
        batch = len(requests)
        width = 1 + max(len(d) for d in drafts)
        context = round(sum(len(r.all_ids) - len(res.tokens) for r, res in zip(requests, results)) / batch)
        self.forward.observe(batch, width, max(context, 0), verify_s)
        depth = max((len(d.nodes_per_depth()) for d in drafts), default=0)
        nodes = sum(len(d) for d in drafts)
        if all(self._drafted_last.get(r.request_id, False) for r in requests):
            self.draft.observe(depth, nodes, batch, draft_s)  # else a model drafter also caught up on skipped tokens
        self._drafted_last = {r.request_id: len(d) > 0 for r, d in zip(requests, drafts)}
        if self._pending is not None and self._pending[0] > 0:
            filled = sum(1 for d in drafts if len(d)) / batch
            self.fill = (1 - self.ema) * self.fill + self.ema * filled
        for request, draft, result in zip(requests, drafts, results):
            if len(draft):
                depth = len(draft.nodes_per_depth())
                self.measured_depth = max(self.measured_depth, min(depth, result.num_accepted + 1, self.max_k))
                self._learn_depth(len(draft), depth)
                self._update(self.alphas.setdefault(request.request_id, list(self.global_alphas)), depth, result.num_accepted)
                self._update(self.global_alphas, depth, result.num_accepted)
        self._account(batch, sum(len(r.tokens) for r in results), draft_s + verify_s, nodes > 0)

    def release(self, request) -> None:
        self.alphas.pop(request.request_id, None)
        self._plan.pop(request.request_id, None)
        self._drafted_last.pop(request.request_id, None)

    def metrics(self) -> dict:
        """Decisions and predicted / realised speedups (for the server's /metrics and the RL loop)."""
        s = self.stats
        spec = max(s["speculative_steps"], 1)
        return {
            "steps": s["steps"], "speculative_steps": s["speculative_steps"], "probes": s["probes"], "switches": s["switches"],
            "speculating": self.on, "budget_histogram": dict(s["budget_hist"]),
            "predicted_speedup_mean": s["predicted_sum"] / spec if s["speculative_steps"] else 1.0,
            "realised_speedup_mean": s["realised_sum"] / spec if s["speculative_steps"] else 1.0,
            "realised_speedup_overall": s["plain_equiv_s"] / s["actual_s"] if s["actual_s"] else 1.0,
            "acceptance_per_position": [round(a, 4) for a in self.global_alphas], "draft_fill": round(self.fill, 4),
            "draft_cost": asdict(self.draft.current),
            "last": dict(s["last"]),
        }

    # ---- prediction -------------------------------------------------------------------------------
    def _rate(self, requests, budget: int, context: int) -> float:
        """Predicted tokens per second of the whole batch if every request drafts `budget` nodes."""
        tokens, seconds = self._step(requests, budget, context)
        return tokens / seconds

    def _step(self, requests, budget: int, context: int) -> tuple[float, float]:
        """Predicted (tokens emitted, seconds) of one step of the batch at this budget."""
        batch = len(requests)
        depth = self._depth(budget)
        if not budget:
            return float(batch), self.forward.predict(batch, 1, context)
        fill = self.fill  # a lookup drafter finds nothing to propose on some steps: those emit 1 token
        tokens = sum(1 + fill * (expected_tokens_per_step(self.alphas.get(r.request_id, self.global_alphas), min(depth, _remaining(r))) - 1)
                     for r in requests)
        wide = 1 - (1 - fill) ** batch  # the verify is 1 + budget wide if any row drafted
        seconds = (self.draft.seconds(depth, batch * budget, batch) + wide * self.forward.predict(batch, 1 + budget, context)
                   + (1 - wide) * self.forward.predict(batch, 1, context))
        return tokens, seconds

    def _depth(self, budget: int) -> int:
        if budget <= self.max_k and budget not in self.depth_of:
            return budget  # a chain until the drafter shows a tree
        return min(self.max_k, max(1, round(self.depth_of.get(budget, self.max_k)))) if budget else 0

    def _could_pay(self, requests, context: int, plain_rate: float) -> bool:
        """Would some budget pay at this batch if every draft were accepted in full? (Else a probe,
        which only re-measures acceptance, cannot change the decision.)"""
        batch, fill = len(requests), self.fill
        for n in range(1, self.max_nodes + 1):
            depth = self._depth(n)
            tokens = sum(1 + fill * min(depth, _remaining(r)) for r in requests)
            seconds = self.draft.seconds(depth, batch * n, batch) + self.forward.predict(batch, 1 + n, context)
            if tokens / seconds >= (1 + ON_MARGIN) * plain_rate:
                return True
        return False

    def _decide(self, best: int, predicted: float, steps: list[tuple[float, float]], could_pay=lambda: True) -> int:
        """Hysteresis on / off (predicted = best speculative rate / plain rate), then probes while off
        (could_pay: whether a perfect draft would pay at this batch); returns this step's budget."""
        wants_change = predicted < 1 - OFF_MARGIN if self.on else predicted >= 1 + ON_MARGIN
        decisive = predicted < 1 - DECISIVE if self.on else predicted >= 1 + DECISIVE
        self._streak = self._streak + 1 if wants_change else 0
        if self._streak >= PATIENCE or decisive:
            self.on, self._streak, self._idle, self._backoff = not self.on, 0, 0, 1
            self.stats["switches"] += 1
        if self.on:
            return best
        self._idle += 1
        probe = min(3, self.max_nodes)
        backoff = self._backoff if could_pay() else MAX_BACKOFF  # else only a wrong cost estimate could be corrected by a probe
        if self._idle >= self._probe_interval(steps, probe) * backoff:
            self._idle, self._backoff = 0, min(self._backoff * 2, MAX_BACKOFF)
            self.stats["probes"] += 1
            return probe
        return 0

    def _probe_interval(self, steps: list[tuple[float, float]], probe: int) -> int:
        """Plain steps between probes so that a probe's net extra time (its time minus the plain time
        its tokens would have taken) is <= PROBE_BUDGET of plain decoding time. Each probe that does not
        turn speculation back on doubles the next interval (MAX_BACKOFF at most): a model drafter's probe
        also catches up on every token skipped since its last draft, which the model does not price."""
        (plain_tokens, plain_s), (probe_tokens, probe_s) = steps[0], steps[probe]
        extra = max(probe_s - plain_s * probe_tokens / plain_tokens, 0.0) / plain_s
        return max(8, math.ceil(extra / PROBE_BUDGET))

    # ---- learning ---------------------------------------------------------------------------------
    def _update(self, alphas: list[float], depth: int, accepted: int) -> None:
        """EMA of the acceptance at each depth up to the first rejection (the depths observed). Depths deeper than
        this draft relax toward the one above them: never-measured ones at once (else a drafter accepting 0.95 at
        every measured depth is priced at the prior beyond them, the deeper budget never looks better and is never
        measured: self_draft stayed at k = 4-6 of 8), measured ones by RELAX a step, so that one unlucky estimate does
        not keep a depth from being tried again; its own measurements correct it from its next draft on."""
        for j in range(min(depth, accepted + 1, self.max_k)):
            alphas[j] = (1 - self.ema) * alphas[j] + self.ema * (1.0 if j < accepted else 0.0)
        for j in range(max(depth, 1), self.max_k):
            rate = 1.0 if j >= self.measured_depth else RELAX
            alphas[j] += rate * (alphas[j - 1] - alphas[j])

    def _learn_depth(self, budget: int, depth: int) -> None:
        old = self.depth_of.get(budget)
        self.depth_of[budget] = depth if old is None else (1 - self.ema) * old + self.ema * depth

    def _account(self, batch: int, emitted: int, seconds: float, speculated: bool) -> None:
        s = self.stats
        s["steps"] += 1
        if self._pending is None:
            return
        budget, predicted, plain_s = self._pending
        self._pending = None
        plain_equiv = emitted / batch * plain_s
        s["plain_equiv_s"] += plain_equiv
        s["actual_s"] += seconds
        s["budget_hist"][budget] = s["budget_hist"].get(budget, 0) + 1
        realised = plain_equiv / seconds if seconds > 0 else 1.0
        if speculated:
            s["speculative_steps"] += 1
            s["predicted_sum"] += predicted
            s["realised_sum"] += realised
        s["last"] = {"batch": batch, "budget": budget, "predicted_speedup": round(predicted, 4), "realised_speedup": round(realised, 4)}


def _remaining(request) -> int:
    """Draft tokens this request can still use (the engine caps budgets the same way)."""
    return max(0, request.params.max_tokens - len(request.output_ids) - 1)


def _prior_machine():
    """This CPU's preset as the roofline prior when no calibration exists (refitted online)."""
    from tandem.sim.hardware import preset
    from tandem.sim.roofline import Machine

    cpu = preset("cpu")
    return Machine("cpu-prior", cpu.memory_bandwidth, cpu.flops("fp32"), overhead_s=0.005, source=cpu.source)


def AdaptiveDraftLength(max_k: int, **kwargs) -> SpeculationController:
    """The former adaptive-k policy's name: a controller with an online-measured cost model."""
    return SpeculationController(max_k, **kwargs)
