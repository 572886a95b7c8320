"""The speculation controller: each step, ask every row for the draft shape that maximises the batch's emitted
tokens per second, plain decoding included (the engine's `draft_policy`).

What it prices (per step, `plan`, called once by Engine._propose): the drafter's shapes (DraftShape: a budget
and the passes it takes; `drafter.shapes()`), plus plain (budget 0). For row r and shape s:
- emitted tokens E_r(s): measured. An EMA per shape engine-wide of what rows drafting s emitted (the recovered or
  bonus token included, empty drafts included: a lookup that finds nothing emits 1), scaled per request by its
  own ratio (its decayed extra tokens over the engine-wide expectation at the shapes it used, shrunk toward 1). A shape never
  measured, or not drafted for STALE steps, is priced from (or drifts toward) the per-depth acceptance of every
  draft seen so far, times the share of drafts that were not empty (an optimistic prior, so it gets tried again);
  the grafted lookup branch of a hybrid, a tree's extra branches and a suffix match's length are all in what a
  shape emits, which the per-depth acceptance of the head's chain alone does not see.
- cost: the drafter's time, fitted from its measured times over (deepest pass, nodes beyond one per pass and row,
  rows drafting: a chain's nodes are its passes, so only lookups, grafted branches and trees inform the node term,
  which would otherwise take a share of every head pass and price a nearly free lookup node like one), plus the
  verify forward's, from the calibrated roofline refitted online, as a function of the rows and of the tokens
  verified: the sum of 1 + nodes over the rows when the engine verifies ragged (no padding), rows x the widest
  row otherwise. Nodes are what the shape was measured to yield (a lookup often yields fewer than its budget).
The plan maximises sum_r E_r(s_r) / (draft + verify) over plans of one shape s for the batch, each row drafting s
or staying plain (_best_plan: free per-row shapes chased noise).
Calibrated against what ran: plain's price at a batch is measured (the first plan at a batch no plain step was timed
near is a plain step; one step prices it), and a drafting plan's predicted speedup is scaled by `calibration(batch)`,
predicted / measured seconds of the drafting steps at the nearest batch size (the drafter's catch-up on missed
steps left out), so a verify the model prices cheap stops looking like a win after one step, not after MEASURED_AFTER
steps of each plan it tries.
Hysteresis: speculation turns on when the best plan is predicted >= (1 + ON_MARGIN) x plain and off below
(1 - OFF_MARGIN), each for PATIENCE plans in a row, or at once when DECISIVE; while off, a plan is made every OFF_REPLAN
steps (the others are plain at no planning cost). While off it probes (the best plan
for one step), spaced so that probing costs at most PROBE_BUDGET of plain decoding time (a probe's cost: the larger of
its predicted and its last measured extra time, which includes catching the drafter up on the rows' plain steps, a cost
no steady-state figure sees), at least 8 steps apart, a floor doubled after each probe that does not turn speculation
back on (up to MAX_BACKOFF), and MAX_BACKOFF times the spacing (at most MAX_PROBE_INTERVAL) where not even drafts
accepted in full would pay at this batch. A probe's measurements move the figures by PROBE_EMA. A probe drafts on at most
PROBE_ROWS rows (in turn): the figures are engine-wide, and catching the drafter up costs per row drafting.
Openings (batch 1): off, a probe costs a draft model its catch-up on every plain step since the last (5-8 plain steps
for the 0.5B drafting for the 1.5B), so probes come too rarely to find the next request that pays, and one request that
accepts little kept drafting off for every request after it. So a new request that arrives while speculation is off
opens: it drafts for OPEN_STEPS steps (its prompt's catch-up is all it pays beyond them) and then the usual hysteresis
judges it, on figures its own steps moved by PROBE_EMA. Openings are priced by what they bought: each opened request's
seconds saved over plain (its drafting steps only; in plain steps) move `open_value`, and requests open while it is
positive, and one in OPEN_RETRY when it is not.
"""
from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from tandem.engine.costs import DraftCostModel, ForwardCost
from tandem.ops.cost import expected_tokens_per_step
from tandem.types import DraftShape, chain_shapes

ON_MARGIN = 0.05
OFF_MARGIN = 0.02
PATIENCE = 3
DECISIVE = 0.15  # a prediction this far beyond 1 switches at once
PROBE_BUDGET = 0.02  # probes cost at most this share of plain decoding time
STEP_EMA = 0.1  # per step, the measured seconds of a plan's kind toward what the step took (in log, the step clipped to 0.5-2x)
MEASURED_AFTER = 3  # steps of one kind of plan before its measured seconds replace the model's
PLAIN_SPACING = 8  # while drafting, steps between the plain steps that measure plain's price at a batch size (until MEASURED_AFTER)
PLAIN_NEAR = 1.5  # a plain step timed at a batch within this factor prices plain well enough to start drafting on
PLAIN_REFRESH = 512  # ... and then between the plain steps that keep it fresh
OFF_REPLAN = 4  # while off, the plan (~0.3 ms at batch 4, 2 % of a plain step) is made every this many steps
PRIOR_ACCEPTANCE = 0.8
MAX_BACKOFF = 8
PROBE_ROWS = 4  # rows a probe drafts on at most
MAX_PROBE_INTERVAL = 4096  # steps: a probe at least this often even where nothing could pay (costs change with the batch)
OPEN_STEPS = 3  # batch 1: a request's opening drafts this many steps before the usual hysteresis judges it
OPEN_PRIOR = 1.0  # plain steps an opening is expected to save before any was measured (optimistic: open until measured to lose)
OPEN_EMA = 0.3  # per finished opened request, the expected saving toward what its opening saved
OPEN_RETRY = 8  # requests: while openings are measured to lose, one request in this many still opens (traffic changes)
RELAX = 0.02  # per step: an undrafted depth's acceptance drifts toward the depth above it; a stale shape toward its prior
SHAPE_EMA = 0.05  # per step, a shape's figure toward what the step measured of it (~20 steps of memory: acceptance comes in bursts no
# plan can foresee, and chasing them drafted deep just as a burst ended)
PROBE_EMA = 0.25  # ... and a probe's (while off, the only measurements: at 0.05 a dozen probes were needed to turn back on)
RATIO_PRIOR = 32.0  # a request's ratio starts as if it had emitted what was expected over this many extra tokens (8 lost to 32 at batch 4: BENCHMARKS 14)
RATIO_DECAY = 0.97  # per drafting step, the weight left to a request's older evidence (~30 steps of memory)
CALIBRATION_EMA = 0.2  # per drafting step, a batch size's predicted and measured seconds (its first steps count as their mean)
CALIBRATION_RANGE = (0.5, 2.0)
STALE = 32  # steps a shape goes undrafted before its measured figure starts drifting back toward the prior
NESTED_PREFERENCE = 0.05  # a shape whose draft nests a better one's is preferred within this share of its rate: drafting it
# measures both, where choosing the narrow one leaves the wide one's figure to lag (at batch 1 chain1 took 18 % of the steps)


class SpeculationController:
    def __init__(self, max_k: int, forward: ForwardCost | None = None, draft: DraftCostModel | None = None,
                 max_nodes: int | None = None, ema: float = 0.25, prior_acceptance: float = PRIOR_ACCEPTANCE,
                 shapes: tuple[DraftShape, ...] | None = None):
        self.shapes = tuple(sorted(shapes or chain_shapes(max_nodes or max_k), key=lambda s: s.budget))
        self.max_k = max_k  # deepest chain the per-depth acceptance (the prior of unmeasured shapes) covers
        self.max_nodes = self.shapes[-1].budget
        self.forward = forward or ForwardCost(refit=True)
        self.draft = draft or DraftCostModel()
        self.ema = ema
        self.budgets = np.array([0] + [s.budget for s in self.shapes])  # [S]: column 0 is plain
        self.prefixes = {s.budget: s.prefix for s in self.shapes}
        self.depths = np.array([0] + [s.depth for s in self.shapes])
        self.global_alphas = [prior_acceptance] * max_k
        self.measured_depth = 0  # how many depths (engine-wide) have had their acceptance measured at least once
        self.emitted: dict[int, float] = {}  # budget -> EMA of tokens a row drafting it emitted (engine-wide)
        self.yielded: dict[int, float] = {}  # budget -> EMA of the nodes the drafter returned for it
        self.measured_rows: dict[int, int] = {}  # budget -> rows that have measured it (its figures are their mean until SHAPE_EMA's weight)
        self.last_used: dict[int, int] = {}  # budget -> the step it was last drafted
        self.fill = 1.0  # EMA: the share of drafts asked for that came back non-empty
        self.evidence: dict[str, tuple[float, float]] = {}  # request -> decayed (extra tokens emitted, extra tokens expected)
        self.ragged = True  # the engine verifies rows without padding (learnt from what it reports)
        self.on, self._streak, self._idle, self._backoff = True, 0, 0, 1
        self._plan: dict[str, int] = {}
        self.step_s: dict[tuple[int, int, int], tuple[float, int]] = {}  # (rows, budget, rows drafting) -> (EMA seconds, steps)
        self._drafted_last: dict[str, bool] = {}  # request -> did its previous step draft
        self._pending: tuple[float, ...] | None = None  # (predicted speedup, plain seconds, plain tokens, calibration, plan seconds)
        self._probing = False  # this step's plan is a probe
        self._plain_checked: dict[int, int] = {}  # batch -> the step a plain step was last taken to measure plain's price
        self.probe_extra: float | None = None  # EMA of a probe's measured extra time over what plain would take for its tokens, in plain steps
        self.step_fit: dict[int, tuple[float, float, int]] = {}  # batch -> EMAs of a drafting step's predicted and measured seconds, steps
        self.open_value = OPEN_PRIOR  # EMA: plain steps an opened request saved (batch 1 openings; module docstring)
        self._seen: set[str] = set()  # requests planned for (released with them)
        self._opening: tuple[str, int] | None = None  # (request, opening steps left)
        self._opening_step = False  # this step's plan is part of an opening
        self._open_saved: dict[str, float] = {}  # opened request -> seconds its drafting steps saved over plain
        self._since_open = 0  # new requests since the last opening
        self.stats = {"steps": 0, "speculative_steps": 0, "probes": 0, "switches": 0, "plain_equiv_s": 0.0, "actual_s": 0.0,
                      "predicted_sum": 0.0, "realised_sum": 0.0, "shape_rows": {}, "last": {}, "plain_checks": 0, "openings": 0}

    @classmethod
    def for_engine(cls, model, drafter, calibration=None, model_name: str | None = None, recalibrate: bool = False,
                   max_k: int | None = None, drafter_factory=None) -> "SpeculationController":
        """A controller for this target + drafter over the drafter's shapes: calibration = a Calibration, a JSON path,
        or None (look up $TANDEM_HOME's record for model_name on this machine; re-measure it when missing or stale if
        `recalibrate`, else fall back to an online-measured model and say so). drafter_factory: the caller's builder of
        a drafter like `drafter` (same options), used only to measure its cost when recalibrating
        (engine.calibrate.resolve_calibration); without it only the target is re-measured."""
        from tandem.engine.calibrate import resolve_calibration
        from tandem.sim.roofline import work_from_config

        shapes = drafter.shapes()
        k = max_k or max(s.depth for s in shapes)
        calib = resolve_calibration(model, drafter, calibration, model_name, recalibrate, drafter_factory)
        if calib is None:
            forward = ForwardCost(work_from_config(model.cfg, model_name or "target"), _prior_machine(), refit=True)
            return cls(k, forward, DraftCostModel(), shapes=shapes)
        prior = calib.drafters.get(drafter.name)
        return cls(k, ForwardCost(calib.work, calib.machine, refit=True), DraftCostModel(prior) if prior else DraftCostModel(), shapes=shapes)

    # ---- the engine's draft_policy interface ---------------------------------------------------------
    def plan(self, requests) -> list[int]:
        """Draft budget per request for this step (0 = plain)."""
        batch = len(requests)
        context = round(sum(len(r.all_ids) for r in requests) / batch)
        opening = self._opening_step = batch == 1 and self._opens(requests[0])
        if not self.on and self.stats["steps"] % OFF_REPLAN:  # off: plain, re-planned only every OFF_REPLAN steps
            self._idle += 1
            self._plan = {r.request_id: 0 for r in requests}
            plain_s = self.forward.predict_total(batch, batch, context)
            self._pending = (1.0, plain_s, float(batch), 1.0, plain_s)
            return [0] * batch
        emitted = self._emitted_matrix(requests)
        price = lambda choice: self._price(choice, emitted, context)  # noqa: E731 - (tokens, seconds) of a plan
        plain_tokens, plain_s = price(np.zeros(batch, dtype=int))
        candidate = self._best_plan(emitted, context)  # the best plan in which some row drafts
        tokens, seconds = price(candidate)
        raw = (tokens / seconds) / (plain_tokens / plain_s)
        predicted = raw * self.calibration(batch)
        if opening:  # the opening's steps draft whatever the figures of earlier requests predict
            chosen = candidate
        else:
            chosen = self._decide(candidate, predicted, price, lambda: self._could_pay(requests, context, plain_tokens / plain_s))
        if self.on and chosen.any() and (self._plain_unmeasured(batch) or self._plain_due(batch)):  # plain's own price, measured: what every plan is compared with
            chosen = np.zeros_like(chosen)
            self.stats["plain_checks"] += 1
        budgets = [int(self.budgets[c]) for c in chosen]
        self._plan = {r.request_id: b for r, b in zip(requests, budgets)}
        chosen_tokens, chosen_s = (tokens, seconds) if chosen is candidate else (plain_tokens, plain_s) if not chosen.any() else price(chosen)
        self._pending = ((chosen_tokens / chosen_s) / (plain_tokens / plain_s), plain_s, plain_tokens, self.calibration(batch), chosen_s)
        return budgets

    def _opens(self, request) -> bool:
        """Does this step of a lone request draft as part of its opening? A request new to the controller while
        speculation is off opens when openings have paid (open_value > 0) or every OPEN_RETRY new requests."""
        rid = request.request_id
        if rid not in self._seen:
            self._seen.add(rid)
            self._since_open += 1
            if not self.on and (self.open_value > 0 or self._since_open >= OPEN_RETRY):
                self.on, self._streak, self._idle, self._backoff = True, 0, 0, 1
                self._opening, self._open_saved[rid], self._since_open = (rid, OPEN_STEPS), 0.0, 0
                self.stats["openings"] += 1
        if self._opening is None or self._opening[0] != rid:
            return False
        left = self._opening[1] - 1
        self._opening = (rid, left) if left > 0 else None
        return True

    def _plain_unmeasured(self, batch: int) -> bool:
        """No plain step was timed at a batch within PLAIN_NEAR of this one: take one before drafting (at batch 16 the
        roofline prior priced plain 10-50 % off, and every prediction and realised speedup is relative to it; the
        first drafting step at a new batch pays the drafter's catch-up on the prompts anyway)."""
        return not any(rows <= PLAIN_NEAR * batch and batch <= PLAIN_NEAR * rows for rows, budget, _ in self.step_s if budget == 0)

    def _plain_due(self, batch: int) -> bool:
        """While drafting, plain steps are only modelled (the verify model extrapolates to one token a row, and a plain
        price 10 % high reads every plan as 10 % faster than it is): a plain step is taken every PLAIN_SPACING steps (from
        the first plan at this batch) until MEASURED_AFTER ran at it, then every PLAIN_REFRESH steps (each costs at most
        that step's gain)."""
        steps = self.step_s.get((batch, 0, 0), (0.0, 0))[1]
        since = self.stats["steps"] - self._plain_checked.setdefault(batch, self.stats["steps"])
        if since >= (PLAIN_SPACING if steps < MEASURED_AFTER else PLAIN_REFRESH):
            self._plain_checked[batch] = self.stats["steps"]
            return True
        return False

    def choose_k(self, request) -> int:
        if request.request_id not in self._plan:
            self.plan([request])
        return self._plan.pop(request.request_id)

    def observe(self, requests, drafts, results, draft_s: float, verify_s: float, verified_tokens: int | None = None) -> None:
        """What the step cost and emitted. verified_tokens: the tokens the verify forward ran (the engine's count;
        None = rows x the widest row, a padded verify)."""
        batch = len(requests)
        width = 1 + max(len(d) for d in drafts)
        verified = verified_tokens if verified_tokens is not None else batch * width
        if len({len(d) for d in drafts}) > 1:
            self.ragged = verified < batch * width
        context = round(sum(len(r.all_ids) - len(res.tokens) for r, res in zip(requests, results)) / batch)
        planned = [self._plan.get(r.request_id, len(d)) for r, d in zip(requests, drafts)]
        drafting = [b for b in planned if b > 0]
        depth, extra = max((self._depth_of(b) for b in drafting), default=0), sum(max(0, len(d) - self._depth_of(b)) for b, d in zip(planned, drafts) if b > 0)
        verify_model_s = self.forward.predict_total(batch, verified, max(context, 0))  # before this step refits it
        self.forward.observe_total(batch, verified, max(context, 0), verify_s)
        caught_up = not drafting or all(self._drafted_last.get(r.request_id, False) for r in requests)  # else a model drafter also caught up
        steady_draft_s = draft_s  # the drafter's seconds with it caught up: what a step of this plan costs
        if drafting:
            if caught_up:
                self.draft.observe(depth, extra, len(drafting), draft_s)
            else:
                steady_draft_s = min(draft_s, self.draft.seconds(depth, extra, len(drafting)))
        if caught_up and len(set(drafting)) <= 1:
            self._time_step((batch, drafting[0] if drafting else 0, len(drafting)), draft_s + verify_s)
        self._drafted_last = {r.request_id: len(d) > 0 for r, d in zip(requests, drafts)}
        self._learn(requests, drafts, results, planned)
        self._relax_stale()
        self._account(batch, sum(len(r.tokens) for r in results), draft_s + verify_s, any(len(d) for d in drafts),
                      steady_draft_s + verify_s, steady_draft_s + verify_model_s)  # the drafter as measured: the calibration is the verify model's error

    def _time_step(self, key: tuple[int, int, int], seconds: float) -> None:
        old, steps = self.step_s.get(key, (seconds, 0))
        clipped = min(max(seconds, 0.5 * old), 2.0 * old)  # a stall (a page fault, another process) moves it little
        self.step_s[key] = (math.exp((1 - STEP_EMA) * math.log(old) + STEP_EMA * math.log(clipped)) if steps else seconds, steps + 1)

    def release(self, request) -> None:
        rid = request.request_id
        for table in (self.evidence, self._plan, self._drafted_last):
            table.pop(rid, None)
        self._seen.discard(rid)
        if self._opening is not None and self._opening[0] == rid:
            self._opening = None
        if rid in self._open_saved:  # what its opening bought, in plain steps at batch 1
            plain_s = self.step_s.get((1, 0, 0), (0.0, 0))[0] or self.forward.predict_total(1, 1, len(request.all_ids))
            self.open_value = _ema(self.open_value, self._open_saved.pop(rid) / plain_s, OPEN_EMA)

    def metrics(self) -> dict:
        """Decisions, per-shape use and what each emits, predicted and realised speedups (the server's /metrics,
        `--json`, the RL loop)."""
        s = self.stats
        spec = max(s["speculative_steps"], 1)
        names = {sh.budget: sh.name for sh in self.shapes} | {0: "plain"}
        return {
            "steps": s["steps"], "speculative_steps": s["speculative_steps"], "probes": s["probes"], "switches": s["switches"],
            "plain_checks": s["plain_checks"], "openings": s["openings"], "open_value": round(self.open_value, 3),
            "speculating": self.on, "ragged": self.ragged,
            "shape_rows": {names[b]: n for b, n in sorted(s["shape_rows"].items())},
            "shape_emitted": {names[b]: round(e, 4) for b, e in sorted(self.emitted.items())},
            "predicted_speedup_mean": s["predicted_sum"] / spec if s["speculative_steps"] else 1.0,
            "realised_speedup_mean": s["realised_sum"] / spec if s["speculative_steps"] else 1.0,
            "realised_speedup_overall": s["plain_equiv_s"] / s["actual_s"] if s["actual_s"] else 1.0,
            "probe_extra_steps": round(self.probe_extra, 3) if self.probe_extra is not None else None,
            "acceptance_per_position": [round(a, 4) for a in self.global_alphas],
            "draft_cost": asdict(self.draft.current),
            "last": dict(s["last"]),
        }

    # ---- prediction -------------------------------------------------------------------------------
    def _emitted_matrix(self, requests) -> np.ndarray:  # [B, S]: predicted tokens each row emits with each shape
        extra = np.array([0.0] + [self._global_emitted(int(b)) - 1 for b in self.budgets[1:]])
        ratios = np.array([[self.request_ratio(r.request_id)] for r in requests])  # one numpy op for the batch, not one a row
        return np.minimum(1 + ratios * extra, self._perfect(requests))  # a row near max_tokens emits no more than it may

    def _perfect(self, requests) -> np.ndarray:  # [B, S]: tokens each row emits with each shape if every node is accepted
        room = np.array([[_remaining(r)] for r in requests])
        return 1 + np.minimum(self.budgets[None, :], room)

    def _global_emitted(self, budget: int) -> float:
        return self.emitted.get(budget, self._prior(budget))

    def request_ratio(self, request_id: str) -> float:
        """A request's extra tokens emitted over the engine-wide expectation at the shapes it drafted, shrunk toward 1
        by RATIO_PRIOR tokens of evidence (an EMA of per-step ratios swung with every draft: at batch 4 it spread the
        rows over every shape and kept rows that would have paid plain)."""
        seen, wanted = self.evidence.get(request_id, (0.0, 0.0))
        return min(4.0, (seen + RATIO_PRIOR) / (wanted + RATIO_PRIOR))

    def _prior(self, budget: int) -> float:
        """A chain at the per-depth acceptance measured so far, on the share of drafts that come back non-empty."""
        return 1 + self.fill * (expected_tokens_per_step(self.global_alphas, min(budget, self.max_k)) - 1)

    def _depth_of(self, budget: int) -> int:
        return int(self.depths[np.searchsorted(self.budgets, budget)]) if budget else 0

    def _yields(self) -> np.ndarray:  # [S]: nodes each shape was measured to yield (its budget until measured)
        return np.array([self.yielded.get(int(b), float(b)) for b in self.budgets])

    def _price(self, choice: np.ndarray, emitted: np.ndarray, context: int, yields: np.ndarray | None = None) -> tuple[float, float]:
        """(tokens emitted, seconds) of the step where row r drafts shape choice[r] (0 = plain)."""
        batch = len(choice)
        tokens = float(emitted[np.arange(batch), choice].sum())
        nodes = (self._yields() if yields is None else yields)[choice]
        drafting = choice > 0
        budgets = set(self.budgets[choice[drafting]].tolist())
        shared = (budgets.pop() if budgets else 0) if len(budgets) <= 1 else None
        extra = float(np.maximum(nodes - self.depths[choice], 0.0)[drafting].sum())  # nodes beyond one per pass: lookups, grafts, trees
        return tokens, self._seconds(batch, shared, int(drafting.sum()), float(nodes.sum()), float(nodes.max(initial=0.0)),
                                     int(self.depths[choice].max()), extra, context)

    def _seconds(self, batch: int, budget: int | None, drafting: int, nodes: float, widest: float, depth: int, extra: float,
                 context: int) -> float:
        """Seconds of a step of `batch` rows of which `drafting` draft (all the same `budget`, or None when they differ):
        `nodes` draft nodes in all, `widest` in the widest row, `depth` passes, `extra` nodes beyond one per pass and row.
        Measured once MEASURED_AFTER such steps ran (a shared budget only), else the model's: the verify of 1 + nodes
        tokens a row (ragged) or the widest row's width for every row (padded), plus the drafter's time."""
        measured = self._measured(batch, budget, drafting) if budget is not None else None
        if measured is not None:
            return measured
        verified = batch + nodes if self.ragged else batch * (1 + widest)
        seconds = self.forward.predict_total(batch, verified, context)
        return seconds + (self.draft.seconds(depth, extra, drafting) if drafting else 0.0)

    def _measured(self, batch: int, budget: int, drafting: int) -> float | None:
        """The measured seconds of a step of `batch` rows where `drafting` of them drafted `budget` (the others plain),
        once MEASURED_AFTER such steps ran; else None (the model prices it)."""
        seconds, steps = self.step_s.get((batch, budget, drafting), (0.0, 0))
        return seconds if steps >= (1 if budget == 0 else MEASURED_AFTER) else None  # plain: one step (its price scales every plan)

    def _best_plan(self, emitted: np.ndarray, context: int) -> np.ndarray:
        """The plan with the highest predicted tokens per second among those where some row drafts (whether it beats
        plain is _decide's call). One shape for the batch: for each shape, every row drafting it, and every row whose
        own tokens at it are worth its marginal seconds at that plan's rate drafting it, the others plain. (Free
        per-row shapes spread a batch of 4 over all eight shapes on noise and ran at 0.90x the best fixed shape:
        the deepest row sets the drafter's passes and a mixed plan pays them for rows that emit little.)"""
        batch = emitted.shape[0]
        nodes = self._yields()
        extra = np.maximum(nodes - self.depths, 0.0)  # [S] nodes beyond one per pass: lookups, grafts, trees
        columns = emitted.sum(axis=0)  # [S] tokens of the batch if every row drafts shape j
        best, best_rate = None, -1.0
        slope = self._verify_slope(batch, float(batch), context)
        cost = self.draft.current
        for j in range(1, len(self.budgets)):
            budget, depth = int(self.budgets[j]), int(self.depths[j])
            rate = columns[j] / self._seconds(batch, budget, batch, batch * nodes[j], nodes[j], depth, batch * extra[j], context)
            if rate > best_rate or (best is not None and self._nests(budget, int(self.budgets[best.max()])) and rate >= (1 - NESTED_PREFERENCE) * best_rate):
                best, best_rate = np.full(batch, j), rate
            if batch == 1:
                continue
            marginal = nodes[j] * slope + extra[j] * cost.per_node_s + cost.per_sequence_s
            worth = (emitted[:, j] - emitted[:, 0]) >= rate * marginal
            drafting = int(worth.sum())
            if 0 < drafting < batch:
                tokens = float(np.where(worth, emitted[:, j], emitted[:, 0]).sum())
                some_rate = tokens / self._seconds(batch, budget, drafting, drafting * nodes[j], nodes[j], depth, drafting * extra[j], context)
                if some_rate > best_rate:
                    best, best_rate = np.where(worth, j, 0), some_rate
        return best

    def _nests(self, wide: int, narrow: int) -> bool:
        """Is the draft at budget `narrow` the first nodes of the draft at `wide` (so drafting `wide` measures both)?"""
        return wide > narrow and self.prefixes.get(wide, 0) >= narrow

    def _verify_slope(self, batch: int, verified: float, context: int) -> float:
        """Seconds one more verified token adds around `verified` (0 for a padded verify: its width is the cap's)."""
        if not self.ragged:
            return 0.0
        return max(self.forward.predict_total(batch, verified + batch, context) - self.forward.predict_total(batch, verified, context), 0.0) / batch

    def _could_pay(self, requests, context: int, plain_rate: float) -> bool:
        """Would some shape pay at this batch if every draft were accepted in full? (Else a probe, which only
        re-measures acceptance, cannot change the decision.)"""
        batch = len(requests)
        perfect = self._perfect(requests).astype(float)
        for j in range(1, len(self.budgets)):
            tokens, seconds = self._price(np.full(batch, j), perfect, context)
            if tokens / seconds >= (1 + ON_MARGIN) * plain_rate:
                return True
        return False

    def _decide(self, best: np.ndarray, predicted: float, price, could_pay=lambda: True) -> np.ndarray:
        """Hysteresis on / off (predicted = the rate of `best`, the best plan that drafts, over plain's): on, it is the
        plan; off, plain, and `best` once in a while as a probe. price(plan) -> (tokens, seconds) predicted."""
        wants_change = predicted < 1 - OFF_MARGIN if self.on else predicted >= 1 + ON_MARGIN
        decisive = predicted < 1 - DECISIVE if self.on else predicted >= 1 + DECISIVE
        self._streak = self._streak + 1 if wants_change else 0
        if self._streak >= PATIENCE or decisive:
            self.on, self._streak, self._idle, self._backoff = not self.on, 0, 0, 1
            self.stats["switches"] += 1
        if self.on:
            return best
        self._idle += 1
        plan = self._probe_rows(best)
        interval = self._probe_interval(price, plan, self._backoff)
        if not could_pay():  # only a wrong cost estimate could be corrected by a probe
            interval = min(interval * MAX_BACKOFF, MAX_PROBE_INTERVAL)
        if self._idle >= interval:
            self._idle, self._backoff = 0, min(self._backoff * 2, MAX_BACKOFF)
            self.stats["probes"] += 1
            self._probing = True
            return plan
        return np.zeros_like(best)

    def _probe_rows(self, plan: np.ndarray) -> np.ndarray:
        """A probe drafts on at most PROBE_ROWS of the plan's rows, taken in turn from probe to probe: what it measures
        (acceptance, emitted per shape) is engine-wide, and its first draft catches the drafter up on every plain step
        of the rows it drafts (EAGLE at 16 rows: 100-230 ms, 4-9 plain steps, for all 16)."""
        rows = np.flatnonzero(plan)
        if len(rows) <= PROBE_ROWS:
            return plan
        keep = rows[(self.stats["probes"] * PROBE_ROWS + np.arange(PROBE_ROWS)) % len(rows)]
        probe = np.zeros_like(plan)
        probe[keep] = plan[keep]
        return probe

    def _probe_interval(self, price, plan: np.ndarray, backoff: int) -> int:
        """Plain steps between probes so that a probe's net extra time (its time minus the plain time its tokens would
        have taken: predicted, or as the last probes measured it when that was more) is <= PROBE_BUDGET of plain
        decoding time, and at least 8 x backoff. (The backoff is a floor, not a factor: a probe's measured time includes
        catching the drafter up on every plain step since the last one, which grows with the interval, and multiplying
        the two made the intervals grow without bound: the demo's engine stayed plain through a block that drafting
        ran 1.67x faster.)"""
        plain_tokens, plain_s = price(np.zeros_like(plan))
        probe_tokens, probe_s = price(plan)
        extra = max(probe_s - plain_s * probe_tokens / plain_tokens, 0.0) / plain_s
        return max(8 * backoff, math.ceil(max(extra, self.probe_extra or 0.0) / PROBE_BUDGET))

    # ---- learning ---------------------------------------------------------------------------------
    def _learn(self, requests, drafts, results, planned: list[int]) -> None:
        """Each shape's figure moves once per step by SHAPE_EMA toward the mean of what this step's rows measured of it.
        A chain also measures every smaller budget of the same drafter (its first b nodes are the draft at budget b:
        min(accepted, b) + 1 tokens; budgets it had nodes to spare for give the same draft), and so does any shape whose
        drafts nest (`DraftShape.prefix`: a chain with a grafted lookup branch), which measures the shapes on the same
        steps (each measured only when chosen, at batch 1 their figures came from different requests and the noise of
        that chose chain1 on a third of the steps). Request ratios are taken against the figures before this step."""
        expected = {b: self._global_emitted(b) - 1 for b in set(planned) if b}
        weight = PROBE_EMA if self._probing or self._opening_step else SHAPE_EMA  # probes and openings are rare: each moves the figures further
        samples: dict[int, list[float]] = {}
        yields: dict[int, list[float]] = {}
        filled, observed = [], []  # per drafting row: was its draft non-empty; (depth, accepted) of the non-empty ones
        for request, draft, result, budget in zip(requests, drafts, results, planned):
            if budget <= 0:
                continue
            emitted, accepted = len(result.tokens), result.num_accepted
            seen, wanted = self.evidence.get(request.request_id, (0.0, 0.0))
            self.evidence[request.request_id] = (RATIO_DECAY * seen + emitted - 1, RATIO_DECAY * wanted + expected[budget])
            yields.setdefault(budget, []).append(len(draft))
            for b, tokens in self._measured_by(budget, draft, result):
                samples.setdefault(b, []).append(tokens)
            filled.append(1.0 if len(draft) else 0.0)
            if len(draft):
                observed.append((len(draft.nodes_per_depth()), accepted))
        if filled:
            self.fill = _ema(self.fill, sum(filled) / len(filled), self.ema)
        if observed:
            self.measured_depth = max(self.measured_depth, max(min(d, a + 1, self.max_k) for d, a in observed))
            self._update(self.global_alphas, observed)
        for b, values in samples.items():
            self.measured_rows[b] = self.measured_rows.get(b, 0) + len(values)
            self.emitted[b] = _ema(self.emitted.get(b), sum(values) / len(values), self._warm(b, len(values), weight))
            self.last_used[b] = self.stats["steps"]
        for b, values in yields.items():
            self.yielded[b] = _ema(self.yielded.get(b), sum(values) / len(values), self._warm(b, len(values), weight))

    def _warm(self, budget: int, rows: int, weight: float) -> float:
        """A shape's figures are the running mean of the rows that measured it until that mean's weight falls to `weight`."""
        return max(weight, rows / self.measured_rows[budget])

    def _measured_by(self, budget: int, draft, result) -> list[tuple[int, float]]:
        """(budget, tokens it would have emitted) for every shape this row's verify measured: its own, and each smaller
        budget whose draft is this draft's first b nodes (any for a chain; up to its shape's `prefix` for a tree), which
        would have emitted the accepted path's leading nodes among those + 1 (the target's tokens along a path do not
        depend on the nodes beside it)."""
        emitted = len(result.tokens)
        nested = budget if draft.is_chain else min(self.prefixes.get(budget, 0), budget)
        out = []
        for b in (int(b) for b in self.budgets[1:] if b < budget and b <= nested):
            lead = next((i for i, node in enumerate(result.accepted_nodes) if node >= b), len(result.accepted_nodes))
            out.append((b, float(lead + 1)))
        return out + [(budget, float(emitted))]

    def _relax_stale(self) -> None:
        """A shape not drafted for STALE steps drifts toward its prior, so one unlucky estimate does not keep it from
        being tried again (its next measurement replaces the drift)."""
        now = self.stats["steps"]
        for budget, last in self.last_used.items():
            if now - last >= STALE:
                self.emitted[budget] += RELAX * (self._prior(budget) - self.emitted[budget])

    def _update(self, alphas: list[float], observed: list[tuple[int, int]]) -> None:
        """Once per step, the acceptance at each depth moves by `ema` toward the mean over this step's drafts that
        observed it (a draft observes the depths up to its first rejection; per row, at batch 4 the estimates swung
        with every draft). Depths beyond the step's deepest draft relax toward the one above them: never-measured ones
        at once (else a drafter accepting 0.95 at every measured depth is priced at the prior beyond them and the
        deeper shape never looks better), measured ones by RELAX a step, so that one unlucky estimate does not keep a
        depth from being tried again."""
        for j in range(self.max_k):
            hits = [1.0 if j < accepted else 0.0 for depth, accepted in observed if j < min(depth, accepted + 1)]
            if hits:
                alphas[j] = (1 - self.ema) * alphas[j] + self.ema * sum(hits) / len(hits)
        for j in range(max(max(depth for depth, _ in observed), 1), self.max_k):
            rate = 1.0 if j >= self.measured_depth else RELAX
            alphas[j] += rate * (alphas[j - 1] - alphas[j])

    def calibration(self, batch: int) -> float:
        """Predicted / measured seconds of the drafting steps at the nearest batch size that drafted (1 before any), the
        factor on a drafting plan's predicted speedup: what the cost model gets wrong between plain's measured price
        and a wide verify (at batch 16 the calibrated roofline priced a 66-token verify at 58 ms; it took 70-90 ms).
        A ratio of averages: an average of per-step ratios reads the noise of single steps as a bias."""
        if not self.step_fit:
            return 1.0
        predicted, measured, _ = self.step_fit[min(self.step_fit, key=lambda b: (abs(math.log(b / batch)), b))]
        low, high = CALIBRATION_RANGE
        return min(max(predicted / measured, low), high)

    def _fit_step(self, batch: int, predicted_s: float, measured_s: float) -> None:
        old_p, old_m, steps = self.step_fit.get(batch, (0.0, 0.0, 0))
        w = max(CALIBRATION_EMA, 1.0 / (steps + 1))
        self.step_fit[batch] = ((1 - w) * old_p + w * predicted_s, (1 - w) * old_m + w * measured_s, steps + 1)

    def _account(self, batch: int, emitted: int, seconds: float, speculated: bool, steady_s: float, model_s: float) -> None:
        """steady_s: the step's seconds without the drafter's catch-up; model_s: the verify model's seconds (before this
        step's refit) for the tokens the step verified plus the drafter's steady seconds as measured, the calibration's
        numerator. Not the plan's own prediction: that also holds the nodes it expected and the drafter did not return,
        an error the shapes' yields already correct (at 16 rows a first step planned for 8 lookup nodes that found none
        read as a model 20 % slow, and kept drafting on at 0.8x for ten steps); nor the drafter's modelled seconds, which
        its own fit corrects (a draft model's first steps, priced at the prior's ~2 ms a depth where the 0.5B takes 10,
        read as a verify model 2x slow, and kept drafting off for the rest of the request)."""
        s = self.stats
        s["steps"] += 1
        for b in self._plan.values():
            s["shape_rows"][b] = s["shape_rows"].get(b, 0) + 1
        if self._pending is None:
            return
        raw, plain_s, plain_tokens, calibration, _ = self._pending  # (the plan's own seconds: for traces)
        predicted = raw * calibration
        self._pending = None
        plain_equiv = emitted / plain_tokens * plain_s
        if speculated:
            self._fit_step(batch, model_s, steady_s)
        if self._probing:
            self._probing = False
            self.probe_extra = _ema(self.probe_extra, max(seconds - plain_equiv, 0.0) / plain_s, 0.5)
        s["plain_equiv_s"] += plain_equiv
        s["actual_s"] += seconds
        realised = plain_equiv / seconds if seconds > 0 else 1.0
        if speculated:
            if batch == 1 and len(self._plan) == 1:
                rid = next(iter(self._plan))
                if rid in self._open_saved:
                    self._open_saved[rid] += plain_equiv - seconds
            s["speculative_steps"] += 1
            s["predicted_sum"] += predicted
            s["realised_sum"] += realised
        s["last"] = {"batch": batch, "drafting_rows": sum(1 for b in self._plan.values() if b), "predicted_speedup": round(predicted, 4),
                     "realised_speedup": round(realised, 4)}


def _ema(old: float | None, value: float, weight: float) -> float:
    return float(value) if old is None else (1 - weight) * old + weight * value


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
