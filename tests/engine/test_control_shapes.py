"""The controller prices every draft shape a drafter offers by what it measured each to emit and to cost, per row.

Known answers: a fake clock (the toy roofline below, exact) and a fake drafter whose tokens emitted per shape are
given; the controller must pick what a hand computation (exhaustive search over the plans) picks.
"""
import itertools
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.control import MEASURED_AFTER, OFF_REPLAN, PATIENCE, PLAIN_REFRESH, PLAIN_SPACING, PROBE_BUDGET, SpeculationController
from tandem.engine.costs import DraftCostModel, ForwardCost
from tandem.sim.roofline import Machine, ModelWork
from tandem.sim.speculative import DraftCost
from tandem.types import DraftShape, DraftTree, VerifyResult, chain_shapes

from test_control import plain_priced

# 1 GB of weights at 10 GB/s (0.1 s), 2 FLOP per parameter per token at 50 GFLOP/s (0.02 s a token): the ridge at 5 tokens
WORK = ModelWork("toy", dense_params=0.5e9, bytes_per_param=2.0, kv_bytes_per_token=0.0, attn_flops_per_token_ctx=0.0)
MACHINE = Machine("toy", bandwidth=10e9, peak_flops=50e9, overhead_s=0.01)
DRAFT = DraftCost(per_depth_s=0.01)  # 10 ms a drafting pass


def verify_s(tokens: int) -> float:  # the fake clock's verify: 0.01 + max(0.1, 0.02 x tokens)
    return 0.01 + max(0.1, 0.02 * tokens)


def req(i, context=64):
    return SimpleNamespace(request_id=f"r{i}", all_ids=list(range(context)), params=SimpleNamespace(max_tokens=1000), output_ids=[])


def result_emitting(n: int) -> VerifyResult:
    return VerifyResult(list(range(n - 1)), list(range(n)), n - 1, False)


def grafted(budget: int) -> DraftTree:
    """The head's chain of 4 and a lookup branch of budget - 4 nodes from the root (a tree, as a hybrid drafts)."""
    branch = budget - 4
    return DraftTree(torch.arange(budget), torch.tensor([-1, 0, 1, 2] + [-1] + [4 + i for i in range(branch - 1)]))


def feed(c, requests, budgets, emitted, steps=3):
    """Steps where row r drafted budgets[r] nodes (a chain up to 4, grafted beyond) and emitted emitted[r] tokens,
    timed by the fake clock."""
    for _ in range(steps):
        drafts = [DraftTree.chain(list(range(b))) if b <= 4 else grafted(b) for b in budgets]
        depth = max((c._depth_of(b) for b in budgets), default=0)
        verified = sum(1 + b for b in budgets)
        c.observe(requests, drafts, [result_emitting(e) for e in emitted], DRAFT.seconds(depth, sum(budgets)), verify_s(verified), verified)


HYBRID = chain_shapes(4) + tuple(DraftShape(4 + n, 4, f"chain4+lookup{n}") for n in (1, 2, 3))
EMITS = {1: 2, 2: 3, 3: 3, 4: 3, 5: 4, 6: 5, 7: 5}  # the fake drafter: tokens emitted per step at each budget (the chain: 2 accepted)


def test_hand_computed_shape_wins_for_a_hybrid_drafter():
    """tokens / (verify + 10 ms x passes) per shape: plain 1/0.11 = 9.1; chain1 2/0.12 = 16.7; chain2 3/0.13 = 23.1;
    chain3 3/0.14 = 21.4; chain4 3/0.15 = 20.0; +lookup1 4/0.17 = 23.5; +lookup2 5/0.19 = 26.3; +lookup3 5/0.21 = 23.8.
    A per-depth chain model would price the lookup shapes from the head's acceptance; measured, +lookup2 wins."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=HYBRID), 1)
    r = req(0)
    for budget, n in EMITS.items():
        feed(c, [r], [budget], [n])
    assert c.plan([r]) == [6]
    assert c.metrics()["shape_emitted"]["chain4+lookup2"] == 5.0


def best_by_search(requests_emits: list[dict[int, int]], budgets: list[int]) -> tuple[float, ...]:
    """The highest tokens / second over every assignment of a budget (or 0) to each row: the hand computation."""
    rates = {}
    for plan in itertools.product([0] + budgets, repeat=len(requests_emits)):
        tokens = sum(e.get(b, 1) for e, b in zip(requests_emits, plan))
        seconds = verify_s(sum(1 + b for b in plan)) + DRAFT.seconds(max(plan), sum(plan))
        rates[plan] = tokens / seconds
    return max(rates, key=rates.get)


def test_rows_that_accept_draft_and_rows_that_do_not_stay_plain():
    """Batch 4, two rows accept every drafted token, two accept none: in a compute-bound verify the rows that accept
    draft (as deep as pays) and the others cost one token each. The plan equals the exhaustive search's."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4)), 4)
    requests = [req(i) for i in range(4)]
    emits = [{b: 1 + b for b in range(1, 5)}, {b: 1 + b for b in range(1, 5)}, {b: 1 for b in range(1, 5)}, {b: 1 for b in range(1, 5)}]
    for b in range(1, 5):
        feed(c, requests, [b] * 4, [e[b] for e in emits])
    plan = c.plan(requests)
    assert tuple(plan) == best_by_search(emits, [1, 2, 3, 4])
    assert plan == [1, 1, 0, 0]  # the accepting rows draft one token each (compute-bound past 5 tokens), the others stay plain



def test_a_nested_shape_also_measures_every_smaller_budget():
    """chain4+lookup4 drafted (nested drafts, `prefix` = budget: budget b's draft is its first b nodes, the head's chain
    then the lookup branch): each smaller budget is measured as the accepted path's leading nodes below b, + 1.
    Accepted along the chain (nodes 0, 1): budget 1 2 tokens, 2-7 3. Along the lookup branch (nodes 4, 5, from the
    root): budgets 1-4 1 token, 5 2, 6-7 3."""
    shapes = tuple(DraftShape(s.budget, s.depth, s.name, prefix=s.budget) for s in chain_shapes(4)) + tuple(
        DraftShape(4 + n, 4, f"chain4+lookup{n}", prefix=4 + n) for n in (1, 2, 3, 4))
    r = req(0)
    for accepted, want in (([0, 1], [2, 3, 3, 3, 3, 3, 3, 3]), ([4, 5], [1, 1, 1, 1, 2, 3, 3, 3])):
        c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=shapes)
        c._plan = {r.request_id: 8}
        c.observe([r], [grafted(8)], [VerifyResult(accepted, [7, 7, 7], 8, False)], 0.05, verify_s(9), 9)
        assert [c.emitted[b] for b in range(1, 9)] == want


def test_a_tree_without_a_prefix_measures_only_itself():
    """The same draft from shapes that declare no prefix (an EAGLE-2 tree's top nodes by score are not its first nodes):
    only the drafted shape is measured."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=HYBRID + (DraftShape(8, 4, "tree8"),))
    r = req(0)
    c._plan = {r.request_id: 8}
    c.observe([r], [grafted(8)], [VerifyResult([0, 1], [7, 7, 7], 8, False)], 0.05, verify_s(9), 9)
    assert c.emitted == {8: 3.0}


def test_while_drafting_plain_is_measured_not_only_modelled():
    """A batch of 4 whose drafts pay: the controller drafts, but its first plan at the batch is a plain step, then one
    every PLAIN_SPACING steps until MEASURED_AFTER ran, then every PLAIN_REFRESH; plain is then priced at what it measured (0.10 s here, where the model
    says 0.11: priced by the model, every plan looked 1.1x faster against plain than it was)."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4))
    requests = [req(i) for i in range(4)]
    steps = PLAIN_REFRESH + 4 * PLAIN_SPACING
    plain_steps = []
    for step in range(steps):
        budgets = c.plan(requests)
        if not any(budgets):
            plain_steps.append(step)
        seconds = 0.10 if not any(budgets) else verify_s(sum(1 + b for b in budgets))
        drafts = [DraftTree.chain(list(range(b))) for b in budgets]
        c.observe(requests, drafts, [result_emitting(1 + b) for b in budgets], DRAFT.seconds(max(budgets), sum(budgets)) if any(budgets) else 0.0,
                  seconds, sum(1 + b for b in budgets))
    first = [0] + [1 + (i + 1) * PLAIN_SPACING for i in range(MEASURED_AFTER - 1)]
    assert plain_steps == first + [first[-1] + PLAIN_REFRESH] and c.stats["plain_checks"] == MEASURED_AFTER + 1
    assert c._seconds(4, 0, 0, 0.0, 0.0, 0, 0.0, 64) == pytest.approx(0.10)

def test_probes_cost_at_most_the_probe_budget_when_nothing_pays():
    """A drafter whose drafts are never accepted, at batch 1 on the fake clock: over 2,000 steps the time spent beyond
    plain decoding's (for the same tokens) is at most PROBE_BUDGET, the first steps (on, from the prior) included."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4))
    r = req(0)
    spent, plain = 0.0, 0.0
    for _ in range(2000):
        [budget] = c.plan([r])
        feed(c, [r], [budget], [1], steps=1)
        spent += verify_s(1 + budget) + DRAFT.seconds(budget, budget)
        plain += verify_s(1)
    assert spent / plain - 1 <= PROBE_BUDGET
    assert not c.on and c.stats["probes"] >= 3



def test_probes_stay_within_the_budget_when_catching_the_drafter_up_costs_more_than_predicted():
    """As above, but the drafter's first draft after plain steps also writes what it missed (an EAGLE head's catch-up),
    0.55 s here (5 plain steps) that no steady-state figure of the model sees: the probes' measured extra time spaces
    them so that probing, from the first step the controller is off, costs at most PROBE_BUDGET (priced by the model
    alone, it cost ~8 %). Counted over whole probe intervals (from step 200 up to the last probe), so that where the
    run happens to end within an interval does not count one probe against a part of its plain steps."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4))
    r = req(0)
    spent, plain, drafted_last, probes = [], [], True, []
    for step in range(6000):
        if step == 200:  # the first steps: on, from the prior, until PATIENCE plans said otherwise
            assert not c.on
        [budget] = c.plan([r])
        if budget and step >= 200:
            probes.append(step)
        draft_s = DRAFT.seconds(budget, budget) + (0.55 if budget and not drafted_last else 0.0)
        c.observe([r], [DraftTree.chain(list(range(budget)))], [result_emitting(1)], draft_s, verify_s(1 + budget), 1 + budget)
        spent.append(verify_s(1 + budget) + draft_s)
        plain.append(verify_s(1))
        drafted_last = budget > 0
    assert len(probes) >= 20
    assert sum(spent[200 : probes[-1]]) / sum(plain[200 : probes[-1]]) - 1 <= PROBE_BUDGET
    assert c.probe_extra == pytest.approx(0.55 / 0.11 + (verify_s(2) + DRAFT.seconds(1, 1) - verify_s(1)) / 0.11, rel=0.05)


def test_drafting_resumes_soon_after_acceptance_returns_though_catching_up_grows_with_the_plain_stretch():
    """Nothing accepted for 600 steps (the controller goes off), then 2 of every draft: each probe's catch-up costs
    1 ms per plain step since the last draft (an EAGLE head writing the queue), so the longer probes are apart, the
    dearer each one. Drafting must resume within 300 steps (at 0.05 a probe, with the backoff multiplying the
    measured cost, the intervals grew without bound and it stayed plain)."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4))
    r = req(0)
    lag, resumed = 0, None
    for step in range(3000):
        [budget] = c.plan([r])
        emitted = 1 + min(budget, 2) if step >= 600 else 1
        draft_s = DRAFT.seconds(budget, budget) + (0.001 * lag if budget else 0.0)
        c.observe([r], [DraftTree.chain(list(range(budget)))], [result_emitting(emitted)], draft_s, verify_s(1 + budget), 1 + budget)
        lag = 0 if budget else lag + 1
        if step == 599:
            assert not c.on
        if step >= 600 and c.on:
            resumed = step
            break
    assert resumed is not None and resumed - 600 <= 300

@pytest.mark.parametrize("ragged", [True, False])
def test_padding_is_priced_when_the_engine_pads(ragged):
    """The same batch as above, but the engine reports a padded verify (rows x the widest row): then a row that
    drafts makes every row pay its width, and at this compute-bound point the best plan drafts less than ragged."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4)), 4)
    requests = [req(i) for i in range(4)]
    emits = [{b: 1 + b for b in range(1, 5)}] * 2 + [{b: 1 for b in range(1, 5)}] * 2
    for b in (1, 2, 3, 4):
        drafts = [DraftTree.chain(list(range(b)))] * 4
        c.observe(requests, drafts, [result_emitting(e[b]) for e in emits], DRAFT.seconds(b, 4 * b), verify_s(4 * (1 + b)), 4 * (1 + b))
    budgets = [1, 1, 0, 0]  # a step whose rows drafted different amounts tells whether the engine padded them
    verified = 6 if ragged else 8
    c.observe(requests, [DraftTree.chain(list(range(x))) for x in budgets], [result_emitting(e.get(x, 1)) for e, x in zip(emits, budgets)],
              DRAFT.seconds(1, 2), verify_s(verified), verified)
    assert c.ragged is ragged
    plan = [c.plan(requests) for _ in range(PATIENCE + 1)][-1]  # past the hysteresis, if the best plan is plain
    padded_search = {}
    for plan_ in itertools.product([0, 1, 2, 3, 4], repeat=4):
        tokens = sum(e.get(b, 1) for e, b in zip(emits, plan_))
        verified = sum(1 + b for b in plan_) if ragged else 4 * (1 + max(plan_))
        padded_search[plan_] = tokens / (verify_s(verified) + DRAFT.seconds(max(plan_), sum(plan_)))
    assert tuple(plan) == max(padded_search, key=padded_search.get)


def test_while_off_the_plan_is_made_every_off_replan_steps(monkeypatch):
    """Off, a step costs no planning except every OFF_REPLAN-th (a plan took ~0.3 ms of a ~16 ms plain step)."""
    c = SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4))
    r = req(0)
    for b in range(1, 5):
        feed(c, [r], [b], [1], steps=10)  # every shape measured to emit what plain emits
    c.on, c.stats["steps"] = False, 0
    c.open_value = -1.0  # openings measured to lose: the request does not open (test_control: openings)
    calls = []
    best_plan = c._best_plan
    monkeypatch.setattr(c, "_best_plan", lambda *a: calls.append(1) or best_plan(*a))
    for _ in range(8 * OFF_REPLAN):
        [budget] = c.plan([r])
        feed(c, [r], [budget], [1], steps=1)  # nothing is accepted: it stays off
    assert len(calls) == 8 and not c.on


def test_measured_step_seconds_replace_a_model_that_misprices():
    """Every draft accepted: on the fake clock chain4 is best (5 tokens / 0.15 s = 33 tok/s; chain3 4 / 0.14 = 28.6).
    If this machine's chain4 steps take 0.5 s (a cliff no roofline draws), MEASURED_AFTER such steps price it at
    10 tok/s and the plan moves to chain3."""
    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4)), 1)
    r = req(0)
    for b in (1, 2, 3):
        feed(c, [r], [b], [b + 1])
    assert c.plan([r]) == [4]  # never drafted: the model's price
    for _ in range(MEASURED_AFTER):
        c.observe([r], [DraftTree.chain([0, 1, 2, 3])], [result_emitting(5)], DRAFT.seconds(4, 4), 0.5 - DRAFT.seconds(4, 4), 5)
    assert c.step_s[(1, 4, 1)] == (pytest.approx(0.5), MEASURED_AFTER)
    assert c.plan([r]) == [3]


def test_a_shape_that_nests_the_best_one_is_preferred_within_its_margin():
    """Rates (hand computed as above): chain2 3 / 0.13 = 23.08; chain4+lookup1, whose draft nests chain2's (drafting it
    measures both), 3.8 / 0.17 = 22.35 = 0.968x: within NESTED_PREFERENCE (5 %), it is drafted; at 3.6 / 0.17 = 21.18
    (0.918x) chain2 is. A lookup shape that does not nest (prefix 0) is never preferred below the best rate."""
    from tandem.engine.control import NESTED_PREFERENCE

    assert NESTED_PREFERENCE == 0.05
    for prefix, figure, expected in ((5, 3.8, 5), (5, 3.6, 2), (0, 3.8, 2)):
        c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4) + (DraftShape(5, 4, "chain4+lookup1", prefix=prefix),)), 1)
        r = req(0)
        for budget, n in {1: 2, 2: 3, 3: 3, 4: 3, 5: 4}.items():
            feed(c, [r], [budget], [n])
        c.emitted = {1: 2.0, 2: 3.0, 3: 3.0, 4: 3.0, 5: figure}  # the chain's figures as fed (chain4+lookup1's steps also measured its prefixes)
        c.evidence.clear()  # the request's own ratio at 1: the engine-wide figures decide
        assert c.plan([r]) == [expected], (prefix, figure)


def test_a_probe_drafts_on_four_rows_in_turn():
    """Off at 16 rows, a due probe drafts the best plan's shape on PROBE_ROWS (4) of its rows, the next probe on the next
    4: its first draft catches the drafter up on every plain step of the rows it drafts (EAGLE at 16 rows: 100-230 ms
    for all 16), and what it measures is engine-wide."""
    from tandem.engine.control import PROBE_ROWS

    c = plain_priced(SpeculationController(4, ForwardCost(WORK, MACHINE), DraftCostModel(DRAFT), shapes=chain_shapes(4)), 16)
    requests = [req(i) for i in range(16)]
    for b in range(1, 5):
        feed(c, requests, [b] * 16, [1 + b] * 16, steps=1)  # every draft accepted: every row would draft
    c.on = False
    drafting = []
    for _ in range(2):
        c._idle, c.stats["steps"] = 10**6, 0  # a probe is due, on a step that plans
        plan = c.plan(requests)
        drafting.append([i for i, b in enumerate(plan) if b])
        feed(c, requests, plan, [1 + b for b in plan], steps=1)
        c.on = False
    assert PROBE_ROWS == 4 and drafting == [[0, 1, 2, 3], [4, 5, 6, 7]]
