"""The speculation controller: off when compute-bound, on when memory-bound, hysteresis, the tail of a
shrinking batch, learning acceptance and drafter costs from what the engine measures."""
import random

import pytest
from types import SimpleNamespace

from tandem.engine.control import AdaptiveDraftLength, SpeculationController, DECISIVE, MAX_BACKOFF, OPEN_RETRY, OPEN_STEPS, PATIENCE, RATIO_DECAY, RATIO_PRIOR
from tandem.engine.costs import REFIT_EVERY, DraftCostModel, ForwardCost, UNIT_MACHINE, UNIT_WORK
from tandem.ops.cost import best_draft_length, expected_tokens_per_step
from tandem.sim.roofline import Machine, ModelWork, forward_seconds
from tandem.sim.speculative import DraftCost
from tandem.types import DraftTree, VerifyResult

# a 1 GB model on a 10 GB/s, 100 GFLOP/s machine: ridge 10 FLOP/B -> 5 tokens per forward (2 FLOP/param)
WORK = ModelWork("toy", dense_params=0.5e9, bytes_per_param=2.0, kv_bytes_per_token=0.0, attn_flops_per_token_ctx=0.0)
MACHINE = Machine("toy", bandwidth=10e9, peak_flops=100e9, overhead_s=0.01)


def req(i, context=64, max_tokens=1000):
    return SimpleNamespace(request_id=f"r{i}", all_ids=list(range(context)), params=SimpleNamespace(max_tokens=max_tokens), output_ids=[])


def plain_priced(c, *batches, context=64):
    """As if one plain step of each batch size had run at the model's own price: the controller drafts at a batch
    only once plain's price there (or within PLAIN_NEAR) is measured, else its first plan is that plain step."""
    for b in batches:
        c.step_s[(b, 0, 0)] = (c.forward.predict_total(b, b, context), 1)
    return c


def controller(max_k=4, acceptance=0.8, draft=DraftCost()):
    return SpeculationController(max_k, ForwardCost(WORK, MACHINE), DraftCostModel(draft), prior_acceptance=acceptance)


def test_expected_tokens():
    assert expected_tokens_per_step([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens_per_step([0.5, 0.5], 2) == 1.75
    assert expected_tokens_per_step([0.9], 0) == 1.0


def test_best_k_follows_acceptance_and_costs():
    verify = [10.0, 11.0, 12.0, 13.0, 14.0]
    assert best_draft_length([0.9] * 4, 0.1, verify) == 4
    assert best_draft_length([0.1] * 4, 0.1, verify) == 0
    assert best_draft_length([0.9] * 4, 20.0, verify) == 0


def test_memory_bound_speculates_at_full_depth():
    c = controller()
    assert c.plan([req(0)]) == [0]  # the first plan at a batch: one plain step, to measure what every plan is compared with
    c.observe([req(0)], [DraftTree.chain([])], [VerifyResult([], [0], 0, False)], 0.0, c.forward.predict(1, 1, 64), 1)
    assert c.plan([req(0)]) == [4]  # 1 x 5 tokens is below the ridge: verifying 5 costs as much as 1
    assert c.metrics()["last"]["drafting_rows"] == 0 and c.on  # the last step accounted: the plain one


def test_compute_bound_turns_off_at_once():
    c = controller(acceptance=0.5)
    batch = [req(i) for i in range(32)]  # compute-bound: 32 x (1 + k) tokens cost (1 + k)x a plain step
    plans = [c.plan(batch) for _ in range(PATIENCE + 5)]
    assert all(p == [0] * 32 for p in plans)  # predicted far below plain: no patience needed
    assert not c.on and c.stats["switches"] == 1
    assert c.stats["probes"] == 0  # not even a perfect draft pays at this batch: nothing to probe


def predicted_at(ratio, acceptance=0.8):
    """A drafter cost that puts the predicted speedup of a k = 4 chain at batch 1 at `ratio`."""
    fwd = ForwardCost(WORK, MACHINE)
    plain = fwd.predict(1, 1, 64)
    tokens = expected_tokens_per_step([acceptance] * 4, 4)
    return DraftCost(fixed_s=tokens * plain / ratio - fwd.predict(1, 5, 64))


def test_a_prediction_just_below_plain_turns_off_after_patience():
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(predicted_at(1 - DECISIVE / 2)), prior_acceptance=0.8), 1)
    plans = [c.plan([req(0)])[0] for _ in range(PATIENCE + 1)]
    assert all(k > 0 for k in plans[: PATIENCE - 1])  # hysteresis: not on the first bad prediction
    assert plans[-1] == 0 and not c.on and c.stats["switches"] == 1


def test_hysteresis_between_margins_keeps_the_state():
    for start_on in (True, False):  # predicted 1.02, between 0.98 and 1.05
        c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(predicted_at(1.02)), prior_acceptance=0.8)
        c.on = start_on
        c.open_value = -1.0  # openings measured to lose: a new lone request does not open (test_openings_*)
        plans = [c.plan([req(0)])[0] for _ in range(50)]
        assert c.on is start_on and c.stats["switches"] == 0
        if not start_on:
            assert 0 < sum(1 for k in plans if k) <= 50 * 0.2  # only probes


def test_tail_of_a_shrinking_batch_turns_speculation_on_at_once():
    c = plain_priced(controller(acceptance=0.5), 32, 16, 8, 4, 2, 1)
    batch = [req(i) for i in range(32)]
    decisions = []
    while batch:
        decisions.append((len(batch), c.plan(batch)[0]))
        batch = batch[: len(batch) // 2] if len(batch) > 1 else []
    assert decisions[0] == (32, 0)  # off from the first step of a full batch
    assert decisions[-1] == (1, 4) and c.on  # batch 1: memory-bound, speculating from its first step
    assert c.stats["switches"] == 2


def run_synthetic(c, steps, acceptance, draft_fn, verify_fn, batch=1, seed=0):
    """Drive the controller like the engine: plan -> draft (chain) -> Bernoulli acceptance -> observe."""
    rng = random.Random(seed)
    requests = [req(i) for i in range(batch)]
    ks = []
    for _ in range(steps):
        plan = c.plan(requests)
        drafts, results = [], []
        for k in plan:
            accepted = 0
            while accepted < k and rng.random() < acceptance[accepted]:
                accepted += 1
            drafts.append(DraftTree.chain(list(range(k))))
            results.append(VerifyResult(list(range(accepted)), list(range(accepted + 1)), k, accepted == k))
        depth, verified = max(plan), sum(1 + len(d) for d in drafts)
        c.observe(requests, drafts, results, draft_fn(depth), verify_fn(batch, verified / batch), verified)
        ks.append(depth)
    return ks


def test_self_draft_that_pays_stays_on():
    """Regression (issue 13): self_draft at k = 4 ran 1.15x plain, the old controller turned it off.
    True costs here: plain 59 ms, verify of 5 tokens 70 ms, drafting (1 + k) x 12 ms (catch-up + k),
    acceptance 0.9 per position: k = 4 emits 4.1 tokens per 130 ms = 1.86x plain."""
    c = SpeculationController(4)  # no calibration: online-measured model from a generic prior
    verify = lambda b, t: 0.059 + 0.00275 * (t - 1)  # noqa: E731
    ks = run_synthetic(c, 300, [0.9] * 4, lambda d: 0.012 * (1 + d) if d else 0.0, verify)
    assert sum(k >= 3 for k in ks[50:]) >= 0.9 * 250  # k = 4 is never tried: its cost is extrapolated
    m = c.metrics()
    assert m["speculative_steps"] >= 270 and m["predicted_speedup_mean"] > 1.3 and m["realised_speedup_mean"] > 1.3


def test_depths_never_drafted_follow_the_deepest_measured_one():
    """Regression (stop 32): self_draft accepting ~0.98 at every depth was held at k = 4-6 of max 8, because depths it
    had not drafted kept the prior 0.8 (or one unlucky estimate), so k = 8 never looked better and was never measured.
    True costs here: verify flat in the width (memory-bound), 7 ms per drafted token, a 21.5 ms plain step: k = 8 emits
    8.3 tokens per 82 ms (102 tok/s), k = 6 99, k = 4 93, k = 3 90. The old rule settled at a mean k of 3.0 / 4.0 over
    the last 200 steps (seeds 0 / 1)."""
    for seed in (0, 1):
        c = SpeculationController(8, ForwardCost(WORK, MACHINE), DraftCostModel(), prior_acceptance=0.8)
        ks = run_synthetic(c, 300, [0.98] * 8, lambda d: 0.007 * d, lambda b, t: 0.021 + 0.0005 * t, seed=seed)
        assert sum(ks[100:]) / 200 >= 6.0
        assert c.measured_depth == 8


def test_a_depth_measured_bad_is_retried_rarely():
    """Acceptance that falls off after depth 4: deeper drafts are tried (a depth not drafted drifts back toward the
    one above it), measured bad, and the plan stays at 4 nearly always."""
    c = SpeculationController(8, ForwardCost(WORK, MACHINE), DraftCostModel(), prior_acceptance=0.8)
    acceptance = [0.97, 0.97, 0.97, 0.97, 0.05, 0.05, 0.05, 0.05]
    ks = run_synthetic(c, 400, acceptance, lambda d: 0.007 * d, lambda b, t: 0.021 + 0.0005 * t)
    assert max(ks) > 4 and c.measured_depth >= 5  # explored
    late = ks[100:]
    assert sum(k > 4 for k in late) <= 0.1 * len(late)
    assert sum(k == 4 for k in late) >= 0.6 * len(late)  # the rest: k < 4 after an unlucky rejection at depth 1-3


def test_drafter_that_never_pays_is_switched_off_and_probed_rarely():
    c = AdaptiveDraftLength(max_k=4)
    ks = run_synthetic(c, 400, [0.05] * 4, lambda d: 0.005 * d if d else 0.0, lambda b, t: 0.04 + 0.002 * t)
    late = ks[100:]
    assert sum(1 for k in late if k == 0) >= 0.9 * len(late)
    assert 0 < sum(1 for k in late if k) <= 0.1 * len(late)
    assert c.metrics()["acceptance_per_position"][0] < 0.3
    assert c.metrics()["probes"] >= 2 and c._backoff >= 4  # each unsuccessful probe doubled the next interval


def test_a_drafter_slower_than_the_target_is_probed_at_the_longest_interval():
    c = AdaptiveDraftLength(max_k=4)  # a drafted token costs more than a target step: no acceptance pays for it
    ks = run_synthetic(c, 4000, [0.05] * 4, lambda d: 0.05 * d if d else 0.0, lambda b, t: 0.04 + 0.002 * t)
    probes = [i for i, k in enumerate(ks) if k and i > 10]  # the first steps: on, from the prior
    # the probe (the best shape: one token) costs 0.05 + 0.044 s for ~1.05 tokens, 1.2 plain steps (0.042 s) more than
    # plain would for them: at a 2 % budget one per ~60 steps, x MAX_BACKOFF since not even full acceptance pays here
    # (the model prices 1.1-1.3 steps as its acceptance estimate falls from the prior: 472-512 apart)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) == 7 and min(gaps) >= 55 * MAX_BACKOFF  # the first at ~480 (on for 8 steps from the prior)


def test_release_forgets_the_request():
    c = plain_priced(controller(), 1)
    r = req(0)
    c.plan([r])
    extra = c._prior(4) - 1  # the engine-wide expectation before the step
    c.observe([r], [DraftTree.chain([1, 2, 3, 4])], [VerifyResult([0], [1, 2], 4, False)], 0.0, 0.02)
    assert c.emitted == {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0}  # one accepted: every budget of the chain emits 2
    assert c.evidence["r0"] == (1.0, pytest.approx(extra))
    assert c.request_ratio("r0") == pytest.approx((1 + RATIO_PRIOR) / (extra + RATIO_PRIOR))
    c.release(r)
    assert "r0" not in c.evidence and c.request_ratio("r0") == 1.0 and c.emitted[4] == 2.0  # the engine-wide figures stay


def test_a_request_ratio_moves_with_evidence_not_with_one_draft():
    """One unlucky draft (nothing accepted where 2 extra tokens were expected) moves a request's ratio by 6 %
    (32 / 34), not to zero; ten such drafts in a row take it to 0.65 (decayed evidence: 2 x sum 0.97^i = 17.5 expected,
    0 emitted)."""
    c = controller()
    r = req(0)
    c.emitted = {b: 3.0 for b in range(1, 5)}  # the engine-wide figure: 2 extra tokens at every budget
    c._plan = {r.request_id: 4}  # each step drafts 4 (whatever the plan would be)
    c.observe([r], [DraftTree.chain([1, 2, 3, 4])], [VerifyResult([], [1], 4, False)], 0.0, 0.02)
    assert c.request_ratio("r0") == pytest.approx(RATIO_PRIOR / (2 + RATIO_PRIOR))
    for _ in range(9):
        c.emitted = {b: 3.0 for b in range(1, 5)}
        c._plan = {r.request_id: 4}
        c.observe([r], [DraftTree.chain([1, 2, 3, 4])], [VerifyResult([], [1], 4, False)], 0.0, 0.02)
    wanted = 2 * sum(RATIO_DECAY ** i for i in range(10))
    assert c.request_ratio("r0") == pytest.approx(RATIO_PRIOR / (wanted + RATIO_PRIOR))


def test_online_refit_learns_the_forward_shape():
    fwd = ForwardCost(UNIT_WORK, refit=True)
    true = lambda b, t: forward_seconds(WORK, MACHINE, b, t, 64)  # noqa: E731
    for _ in range(REFIT_EVERY // 5 + 1):
        for b, t in ((1, 1), (1, 5), (4, 1), (4, 5), (16, 5)):
            fwd.observe(b, t, 64, true(b, t))
    assert fwd.refits == 2  # after 8 and 24 of the 35 timings (the first refits come sooner)
    for b, t in ((2, 3), (8, 2), (32, 5)):
        assert fwd.predict(b, t, 64) / true(b, t) == pytest.approx(1, abs=0.01)


def test_forward_prediction_is_monotone_in_the_tokens_whatever_the_noise():
    """Noisy timings of a machine flat up to 8 tokens then 1 ms a token (what a Zen 5 measured at batch 4): the refit
    curve never prices more tokens cheaper, and plain (4 tokens) costs what one token a row more (8) costs."""
    rng = random.Random(0)
    fwd = ForwardCost(WORK, MACHINE, refit=True)
    true = lambda n: 0.0205 + 0.001 * max(0, n - 8)  # noqa: E731
    for _ in range(REFIT_EVERY * 4 + REFIT_EVERY // 2):  # ends between refits
        n = rng.choice([4, 6, 8, 12, 16, 20])
        fwd.observe_total(4, n, 64, true(n) * rng.uniform(0.9, 1.1))
    predicted = [fwd.predict_total(4, n, 64) for n in range(4, 37)]
    assert all(b >= a * (1 - 1e-6) for a, b in zip(predicted, predicted[1:]))  # to interpolation's rounding
    assert predicted[8 - 4] / predicted[0] == pytest.approx(1, abs=0.05)
    assert predicted[20 - 4] / true(20) == pytest.approx(1, abs=0.08)


def test_online_refit_that_fits_no_roofline_keeps_the_model_it_has():
    """Step times flat in batch and tokens (a machine where overhead dominates) fit no bandwidth term: the refit
    must keep the current roofline, not raise mid-run (it stopped `tandem rl`), and its corrections learn the flat
    times where they were measured."""
    fwd = ForwardCost(UNIT_WORK, refit=True)
    for _ in range(REFIT_EVERY):
        for b, t in ((1, 1), (1, 5), (4, 1), (4, 5), (16, 5)):
            fwd.observe(b, t, 64, 0.01)
    assert fwd.machine is UNIT_MACHINE and fwd.refits == 6  # at 8, 24, 48, 80, 112, 144 of 160 timings
    for b, t in ((1, 1), (1, 5), (4, 1), (4, 5), (16, 5)):
        assert fwd.predict(b, t, 64) == pytest.approx(0.01, rel=0.1)  # shrunk toward the unit roofline by 3 of ~32 timings


def test_a_step_in_the_measured_times_is_priced():
    """What a roofline cannot draw (a Zen 5 at batch 1: 1-2 tokens 10 ms, 3-9 tokens 13.5 ms): the corrections price
    each measured token count near its median, and unmeasured counts between them in between."""
    fwd = ForwardCost(WORK, MACHINE, refit=True)
    measured = {1: 0.010, 2: 0.010, 3: 0.0135, 5: 0.0135, 9: 0.0135}
    for i in range(REFIT_EVERY * 4):
        n = list(measured)[i % 5]
        fwd.observe_total(1, n, 64, measured[n])
    for n, seconds in measured.items():  # ~26 timings each, their deviation from the mean shrunk by 3: within 3 %
        assert fwd.predict_total(1, n, 64) == pytest.approx(seconds, rel=0.03)
    assert fwd.predict_total(1, 4, 64) == pytest.approx(0.0135, rel=0.02)


def test_catch_up_after_plain_steps_does_not_count_as_drafting_cost():
    """A model drafter's first draft after plain steps also processes the skipped tokens: that step's
    draft time must not inflate the per-step drafting cost (it kept self_draft switched off)."""
    c = controller(draft=DraftCost(per_depth_s=0.01))
    r = req(0)
    draft, result = DraftTree.chain([1, 2, 3, 4]), VerifyResult([0, 1], [1, 2, 3], 4, False)
    c.observe([r], [draft], [result], 5.0, 0.1)  # first step: prefill catch-up of the whole prompt
    assert c.draft.current == DraftCost(per_depth_s=0.01)
    c.observe([r], [draft], [result], 0.04, 0.1)  # steady: learnt
    assert abs(c.draft.seconds(4, 4) - 0.04) < 0.005


def test_a_lookup_drafter_that_rarely_finds_a_draft_is_discounted():
    c = controller()
    r = req(0)
    for _ in range(20):  # budget 4 planned, the drafter returned nothing
        c.plan([r])
        c.observe([r], [DraftTree.empty()], [VerifyResult([], [7], 0, False)], 0.0, 0.11, 1)
    assert c.emitted[4] == 1.0 and c.yielded[4] < 0.01  # it emits what plain emits and verifies ~nothing more
    assert c.metrics()["shape_emitted"]["chain4"] == 1.0


def test_past_the_token_counts_measured_the_time_grows_as_the_calibration_says():
    """An engine decoding plain measures its forwards only below the ridge (here 25 tokens), and a roofline refitted to
    them has no compute roof (`refitted`, what the online fit made of a Zen 5's plain steps). A 96-token verify at 16
    rows is priced from the 16-token time grown as the calibrated roofline grows: 0.95 x its 0.25 s, not along the
    refitted line (0.95 x 0.158 s, 37 % low: at 16 rows every verify shape looked like a win until tried)."""
    calibrated = Machine("calibrated", bandwidth=10e9, peak_flops=5e11, overhead_s=0.01, per_token_s=0.0005)
    fwd = ForwardCost(WORK, calibrated, refit=True)
    fwd.machine = Machine("refitted", bandwidth=10e9, peak_flops=1e15, overhead_s=0.01, per_token_s=0.0005)
    for _ in range(REFIT_EVERY):
        fwd.observe_total(16, 16, 64, 0.95 * forward_seconds(WORK, calibrated, 16, 1.0, 64))
    assert fwd.refits >= 1 and fwd.machine.name == "refitted"  # one token count: the roofline is not refitted
    assert forward_seconds(WORK, calibrated, 16, 1.0, 64) == pytest.approx(0.118)
    assert forward_seconds(WORK, calibrated, 16, 6.0, 64) == pytest.approx(0.25)
    assert fwd.predict_total(16, 16, 64) == pytest.approx(0.95 * 0.118, rel=1e-6)
    assert fwd.predict_total(16, 96, 64) == pytest.approx(0.95 * 0.25, rel=1e-6)
    assert fwd.predict_total(16, 32, 64) == pytest.approx(0.95 * forward_seconds(WORK, calibrated, 16, 2.0, 64), rel=1e-6)


def test_a_verify_the_model_prices_cheap_is_corrected_after_one_drafting_step():
    """The model predicts drafting at 1.3x plain; this machine's drafting steps take twice what the model priced them
    (batch 16 on a 2-core CPU: a 66-token verify priced at 58 ms took 70-90). After the first drafting step the
    calibration is predicted / measured seconds (0.5), which takes the prediction to 0.65, below plain at once
    (DECISIVE), not after MEASURED_AFTER steps of each (rows, budget, rows drafting) the plans go through."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(predicted_at(1.3)), prior_acceptance=0.8), 1)
    r = req(0)
    budgets = []
    for _ in range(6):
        [budget] = c.plan([r])
        plan_s = c._pending[4]
        accepted = list(range(min(budget, 2)))  # 3 tokens a draft: near the prior's 3.36
        c.observe([r], [DraftTree.chain(list(range(budget)))], [VerifyResult(accepted, list(range(len(accepted) + 1)), budget, False)],
                  0.0, 2 * plan_s if budget else plan_s, 1 + budget)
        if budget and len(budgets) == 0:
            assert c.calibration(1) == pytest.approx(0.5)
        budgets.append(budget)
    assert budgets[0] == 4 and budgets[1:] == [0] * 5 and not c.on


def test_a_draft_shorter_than_planned_is_not_read_as_an_error_of_the_cost_model():
    """The plan prices chain4 (a 5-token verify and 4 drafting passes); the drafter returns 1 node and the step takes
    exactly what the model predicts for the step as it ran (a 2-token verify). The calibration compares the model with
    that step (1.0), not with the plan (which read as a model 1.3x too slow here, and at 16 rows kept drafting on at
    0.8x plain for ten steps); the shorter draft is the shapes' yields' to learn."""
    compute_bound = Machine("toy-compute", bandwidth=10e9, peak_flops=10e9, overhead_s=0.01)  # 0.01 + 0.1 s a token
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, compute_bound), DraftCostModel(DraftCost(per_depth_s=0.005)), prior_acceptance=1.0), 1)
    r = req(0)
    [budget] = c.plan([r])
    assert budget == 4
    plan_s = c._pending[4]
    verify_s, draft_s = c.forward.predict_total(1, 2, 63), c.draft.seconds(4, 0, 1)  # context: 64 ids less the token emitted
    assert plan_s / (verify_s + draft_s) > 1.3
    c.observe([r], [DraftTree.chain([7])], [VerifyResult([], [5], 1, False)], draft_s, verify_s, 2)
    assert c.calibration(1) == pytest.approx(1.0)


def test_a_shapes_figure_is_the_mean_of_its_first_rows_then_an_ema():
    """A shape's emitted tokens are the mean of the rows that measured it until that mean's weight falls to SHAPE_EMA:
    a first step's luck does not stand for ~20 steps (at 16 rows a first chain3 step emitting 2.9 a row, against 2.4
    after, priced drafting at 1.05x plain while it ran at 0.8x)."""
    from tandem.engine.control import SHAPE_EMA

    c = plain_priced(controller(), 1)
    r = req(0)
    for emitted in (3, 2, 2):
        c._plan = {r.request_id: 2}
        accepted = list(range(emitted - 1))
        c.observe([r], [DraftTree.chain([1, 2])], [VerifyResult(accepted, list(range(emitted)), 2, False)], 0.01, 0.05, 3)
    assert c.emitted[2] == pytest.approx(7 / 3)
    for _ in range(30):
        c._plan = {r.request_id: 2}
        c.observe([r], [DraftTree.chain([1, 2])], [VerifyResult([0, 1], [0, 1, 2], 2, False)], 0.01, 0.05, 3)
    n = 33
    want = 7 / 3
    for i in range(4, n + 1):
        want += max(SHAPE_EMA, 1 / i) * (3 - want)
    assert c.emitted[2] == pytest.approx(want)


def test_an_uncalibrated_forward_model_takes_its_level_from_the_first_steps_measured():
    """Before its first refit the level is the mean of measured / predicted (in log): a prior 8x off (the 1.5B with no
    calibration on the machine priced a 31 ms plain step at 252 ms, and the EMA kept drafting off for 8 steps) is
    right after one step. After a refit the level moves by LEVEL_EMA a step again."""
    import math

    from tandem.engine.costs import LEVEL_EMA

    fwd = ForwardCost(WORK, MACHINE, refit=True)
    prior = fwd.predict_total(1, 1, 64)
    fwd.observe_total(1, 1, 64, prior / 8)
    assert fwd.predict_total(1, 1, 64) == pytest.approx(prior / 8)
    fwd.observe_total(1, 1, 64, prior / 2)
    assert fwd.predict_total(1, 1, 64) == pytest.approx(prior / 4)  # the geometric mean of 1/8 and 1/2
    for _ in range(6):  # the 8th timing refits
        fwd.observe_total(1, 1, 64, prior / 4)
    assert fwd.refits == 1 and fwd.level == 1.0
    refitted = fwd.predict_total(1, 1, 64)
    fwd.observe_total(1, 1, 64, 2 * refitted)
    assert fwd.predict_total(1, 1, 64) == pytest.approx(refitted * 2 ** LEVEL_EMA)
    assert math.isclose(fwd.level, 2 ** LEVEL_EMA)


def test_a_drafter_slower_than_its_prior_is_not_read_as_an_error_of_the_verify_model():
    """A draft model's passes take 10 ms where the drafter's prior says 2 (the 0.5B drafting for the 1.5B). A caught-up
    drafting step whose verify takes exactly what the verify model predicts leaves the calibration (the verify
    model's error) at 1.0, and the draft fit learns the 40 ms. Before, the calibration compared the step with the
    modelled drafter too and read a verify model 1.3x slow, which with one unlucky draft kept drafting off for the rest
    of the request."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DraftCost(per_depth_s=0.002)), prior_acceptance=1.0), 1)
    r = req(0)
    [budget] = c.plan([r])
    assert budget == 4
    c._drafted_last[r.request_id] = True  # its previous step drafted: nothing to catch up
    verify_s = c.forward.predict_total(1, 5, 59)  # context: 64 ids less the 5 tokens emitted
    c.observe([r], [DraftTree.chain([1, 2, 3, 4])], [VerifyResult([0, 1, 2, 3], [1, 2, 3, 4, 5], 4, False)], 0.040, verify_s, 5)
    assert c.calibration(1) == pytest.approx(1.0)
    assert c.draft.seconds(4, 0, 1) > 0.002 * 4 * 2


# ---- openings: a new lone request drafts its first steps while speculation is off --------------------------------
PLAIN_S, PASS_S, PROMPT_CATCH_UP_S, TOKEN_CATCH_UP_S = 0.031, 0.010, 0.27, 0.003  # the 1.5B with the 0.5B drafting


def serve_one_by_one(c, acceptances, tokens, seed=0):
    """Requests of `tokens` new tokens served alone, in turn, as with a draft model: drafting pays the draft model's
    catch-up on the request's prompt at its first draft (~9 plain steps) and on every token committed since its last
    draft, then PASS_S a pass; the verify of 1 + k tokens costs PLAIN_S + 1 ms a drafted token. acceptances: per
    request, the chance each drafted token is accepted. Returns per request the steps that drafted, and the seconds."""
    rng = random.Random(seed)
    drafted_steps, seconds = [], 0.0
    for i, acceptance in enumerate(acceptances):
        r = req(i, max_tokens=tokens)
        missed, drafted_before, drafting = 0, False, 0
        while len(r.output_ids) < tokens:
            [k] = c.plan([r])
            accepted = 0
            while accepted < k and rng.random() < acceptance:
                accepted += 1
            draft_s = 0.0
            if k:
                draft_s = (TOKEN_CATCH_UP_S * missed if drafted_before else PROMPT_CATCH_UP_S) + PASS_S * k
                drafted_before, missed, drafting = True, 0, drafting + 1
            verify_s = PLAIN_S + 0.001 * k
            seconds += draft_s + verify_s
            result = VerifyResult(list(range(accepted)), list(range(accepted + 1)), k, accepted == k)
            c.observe([r], [DraftTree.chain(list(range(k)))], [result], draft_s, verify_s, 1 + k)
            r.output_ids.extend(range(accepted + 1))
            r.all_ids.extend(range(accepted + 1))
            missed += 0 if k else 1
        c.release(r)
        drafted_steps.append(drafting)
    return drafted_steps, seconds


def test_openings_find_the_requests_that_pay_after_one_that_did_not():
    """Regression (stop 62, BENCHMARKS 14): the 1.5B with the 0.5B drafting under the controller drafted on almost no
    step after its warm-up request, which accepted little: off, a probe pays the 0.5B's catch-up, so probes come
    rarely. Here a first request accepts 0.05 and turns speculation off, then six accept 0.9 (a chain of 4 emits ~4.1
    tokens a 75 ms step, 1.7x plain). The next request opens: its first OPEN_STEPS steps draft whatever the figures of
    the first one predict. Served this way the seven take >= 3 % less time than without openings, on every seed."""
    c = SpeculationController(4)
    serve_one_by_one(c, [0.05], 128)
    assert not c.on and c.open_value > 0  # off, and no opening measured yet: the prior expects them to pay
    nxt = req(1, max_tokens=128)
    assert [c.plan([nxt])[0] > 0 for _ in range(OPEN_STEPS)] == [True] * OPEN_STEPS and c.stats["openings"] == 1
    for seed in range(3):
        acceptances = [0.05] + [0.9] * 6
        c, closed = SpeculationController(4), SpeculationController(4)
        closed.open_value = -1.0  # openings measured to lose: none for OPEN_RETRY new requests (the code before them)
        drafted, seconds = serve_one_by_one(c, acceptances, 128, seed)
        drafted_closed, seconds_closed = serve_one_by_one(closed, acceptances, 128, seed)
        assert c.stats["openings"] >= 1 and closed.stats["openings"] == 0
        assert drafted[1] > 1.5 * drafted_closed[1]  # the first good request drafts from its start
        assert seconds < 0.97 * seconds_closed


def test_openings_that_lose_stop_but_one_request_in_open_retry_still_opens():
    """Every request accepts 0.05: the first openings lose their prompt's catch-up and OPEN_STEPS drafting steps, the
    measured value of an opening turns negative, and from then on one new request in OPEN_RETRY opens. All the
    drafting together (openings and probes) costs < 5 % of plain decoding time."""
    c = SpeculationController(4)
    n, tokens = 24, 100
    drafted, seconds = serve_one_by_one(c, [0.05] * n, tokens)
    assert c.open_value < 0
    assert drafted[0] >= OPEN_STEPS and c.stats["openings"] <= 2 + n // OPEN_RETRY
    assert seconds < 1.05 * n * tokens * PLAIN_S
