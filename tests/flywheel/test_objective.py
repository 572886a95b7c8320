"""The flywheel's loss terms: the branch pass's tree mask, the discard estimator for sampled traffic."""
import pytest
import torch

from tandem.flywheel.objective import branch_batch, discard_events, evaluated_proposals, generated_roots, trace_example
from tandem.flywheel.packing import packed_branch_hidden, packed_unroll
from tandem.flywheel.traces import TraceAssembler
from tandem.models.eagle import target_to_draft
from tandem.ops.losses import discard_loss, rejection_probability
from tandem.ops.sampling import sampling_probs
from tandem.types import RequestStep, StepRecord

from flywheel_helpers import eagle_engine, served_traces


@pytest.fixture(scope="module")
def served(target):
    engine = eagle_engine(target)
    return engine.drafter.head.eval(), served_traces(target, n=4, seed=3, engine=engine, branch_depth=4)


def _path_logits(head, trace, i: int) -> torch.Tensor:  # [Vd]: node i's logits with its ancestry as a plain causal sequence
    chain = [i]
    while int(trace.branch_parent[chain[-1]]) >= 0:
        chain.append(int(trace.branch_parent[chain[-1]]))
    chain.reverse()  # top ancestor .. i
    top = int(trace.branch_pos[chain[0]])
    feats = [trace.features[:top].float(), trace.features[top : top + 1].float()]
    feats += [trace.branch_features[j : j + 1].float() for j in chain[:-1]]  # each node reads its parent's target state
    ids = torch.cat([trace.tokens[1 : top + 1], trace.branch_token[chain]]).unsqueeze(0)
    positions = torch.cat([torch.arange(top), trace.branch_pos[chain]]).unsqueeze(0)
    logits, _ = head(ids, head.fuse([torch.cat(feats).unsqueeze(0)]), positions)
    return logits[0, -1]


@torch.no_grad()
def test_branch_nodes_see_only_their_ancestors(served):
    """One tree-masked pass gives every branch node the logits it gets with its own ancestry as a causal
    sequence: never the committed entries at the positions its branch took over (this failed with the
    mask that showed a node every committed entry before its own position), nor another trace's entries
    (every trace's nodes run in one pass over the traces packed together)."""
    head, traces = served
    roots = [generated_roots(t) for t in traces]
    packed = packed_unroll(head, [trace_example(t) for t in traces], 1, roots, roots)
    states = packed_branch_hidden(head, [branch_batch(t) for t in traces], packed)
    deep = 0
    for trace, state in zip(traces, states):
        if state is None:
            continue
        logits = head.lm_head(state)
        kept = torch.nonzero(trace.branch_pos < len(trace.features)).flatten().tolist()
        for row, i in enumerate(kept):
            torch.testing.assert_close(logits[row], _path_logits(head, trace, i), atol=1e-4, rtol=1e-4)
            deep += int(trace.branch_parent[i] >= 0)
    assert deep > 0  # nodes below a rejected node were checked (the case the old mask got wrong)


def _entry(tokens, parents, accepted, target_probs, draft_probs, context_len=5, sampling=(0.8, 0, 1.0), finish=None):
    n = len(tokens)
    return RequestStep(
        request_id="r", tags={}, context_len=context_len, pending_token=9, draft_tokens=tokens, draft_parents=parents, accepted_nodes=accepted,
        emitted_tokens=[tokens[j] for j in accepted] + [7], bonus=False, finish_reason=finish, context_ids=list(range(context_len)),
        node_target_probs=torch.tensor(target_probs), node_draft_probs=torch.tensor(draft_probs), hidden=torch.zeros(3, n + 1, 2),
        final_hidden=torch.zeros(n + 1, 2), sampling=sampling,
    )


def test_evaluated_proposals_are_the_children_of_the_accepted_path():
    assembler = TraceAssembler()
    prefill = RequestStep(request_id="r", tags={}, context_len=0, pending_token=-1, draft_tokens=[], draft_parents=[], accepted_nodes=[],
                          emitted_tokens=[9], bonus=False, context_ids=list(range(5)), hidden=torch.zeros(3, 5, 2), final_hidden=torch.zeros(1, 2),
                          sampling=(0.8, 0, 1.0))
    assembler.add(StepRecord(0, 0.0, 0, [prefill], kind="prefill", taps=(0, 1, 2)))
    # step 1 at position 5: chain 1 -> 2 -> 3, node 0 accepted (p 0.6 < q 0.8), node 1 rejected, node 2 never evaluated
    assembler.add(StepRecord(1, 0.0, 1, [_entry([1, 2, 3], [-1, 0, 1], [0], [0.6, 0.1, 0.5], [0.8, 0.4, 0.9])], taps=(0, 1, 2)))
    # step 2 at position 7: chain 4 -> 5, both accepted
    (trace,) = assembler.add(StepRecord(2, 0.0, 1, [_entry([4, 5], [-1, 0], [0, 1], [0.9, 0.3], [0.5, 0.6], context_len=7, finish="length")], taps=(0, 1, 2)))
    assert trace.sampling == (0.8, 0, 1.0)
    p = evaluated_proposals(trace)
    assert p.root.tolist() == [4, 4, 6, 6] and p.depth.tolist() == [0, 1, 0, 1] and p.token.tolist() == [1, 2, 4, 5]
    torch.testing.assert_close(p.weight, torch.tensor([0.25, 0.75, 0.0, 0.5]))  # r = 1 - min(1, p / q), accepted or not


def test_sampled_discard_estimator_has_the_known_expectation():
    """For a drafting distribution q (temperature 0.7, top-k 4 over logits z) and target p, the estimator
    (every evaluated proposal x ~ q weighted once by r(x), summed, over N draws) converges to
    D = sum_x max(0, q(x) - p(x)) * -log(1 - q(x)), with q_theta the *drafting* distribution. 40000 draws
    with a fixed seed: the standard error is < 0.3 % of D, the tolerance 2 % (false failure ~ 0)."""
    z = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0]])
    p = torch.tensor([0.10, 0.45, 0.15, 0.20, 0.05, 0.05])
    temperature, top_k, top_p = torch.tensor([0.7]), torch.tensor([4]), torch.tensor([1.0])
    q = sampling_probs(z, temperature, top_k, top_p)[0]
    expected = float((torch.clamp(q - p, min=0) * -torch.log1p(-q.clamp(max=1 - 1e-12))).sum())
    n = 40000
    x = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0))
    r = rejection_probability(p[x], q[x])
    rows = z.expand(n, -1)
    estimate = float(discard_loss(rows, x, r, temperature.expand(n), top_k.expand(n), top_p.expand(n)))
    assert estimate == pytest.approx(expected, rel=0.02)
    # what it replaced is biased: rejected proposals only, weighted by r again (r twice), under the T = 1 softmax
    rejected = torch.rand(n, generator=torch.Generator().manual_seed(1)) < r
    old = float(discard_loss(rows[rejected], x[rejected], r[rejected])) * int(rejected.sum()) / n
    assert abs(old - expected) > 0.2 * expected


def test_discard_gradient_matches_the_objective():
    """Gradient of the estimator's expectation (sum over x of q(x) r(x) ell(x), weights held) equals the gradient of D."""
    z = torch.tensor([[1.0, 0.3, -0.2, 0.8]], requires_grad=True)
    p = torch.tensor([0.1, 0.5, 0.3, 0.1])
    t, k, tp = torch.tensor([1.3]), torch.tensor([0]), torch.tensor([0.9])
    q = sampling_probs(z.detach(), t, k, tp)[0]
    r = rejection_probability(p, q)
    tokens = torch.arange(4)
    exact = (q * r * 4).detach()  # sum_x q r ell = mean over the 4 tokens of (4 q r) ell
    discard_loss(z.expand(4, -1), tokens, exact, t.expand(4), k.expand(4), tp.expand(4)).backward()
    z2 = z.detach().clone().requires_grad_(True)
    kept = sampling_probs(z2.detach(), t, k, tp)[0] > 0
    q_theta = torch.softmax((z2[0] / t).masked_fill(~kept, float("-inf")), -1)
    (torch.clamp(q - p, min=0) * -torch.log1p(-q_theta.clamp(max=1 - 1e-9))).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad)


def test_greedy_events_are_the_rejections(served, target):
    head, traces = served
    to_draft = target_to_draft(head.draft_to_target, head.cfg.target_vocab_size)
    for trace in traces:
        events, normaliser = discard_events(trace, to_draft, 4, generated_roots(trace))
        keep = to_draft[trace.reject_token] >= 0
        assert events.root.tolist() == trace.reject_root[keep].tolist() and events.depth.tolist() == trace.reject_depth[keep].tolist()
        assert events.weight.tolist() == [1.0] * len(events.root) and normaliser == len(events.root)


def _loss_trace_by_trace(head, target_rows, traces, cfg, generator):
    """The flywheel loss as it was computed before the LM head was batched: every trace's own LM-head calls."""
    import math

    from tandem.flywheel.objective import branch_loss, discard_term, trace_example
    from tandem.training.offline import eagle_logits, step_stats

    to_draft = target_to_draft(head.draft_to_target.cpu(), head.cfg.target_vocab_size)
    total = 0.0
    for trace in traces:
        roots = generated_roots(trace)
        events, normaliser = discard_events(trace, to_draft, cfg.unroll, roots)
        sampled = roots[torch.randperm(len(roots), generator=generator)[: max(1, math.ceil(cfg.chain_fraction * len(roots)))]]
        chains = torch.unique(torch.cat([sampled, events.root[events.depth > 0]]))
        example = trace_example(trace)
        logits, step_roots = eagle_logits(head, [example], cfg.unroll, chains, roots)
        total = total + step_stats([example], target_rows, logits, step_roots, head.draft_to_target).loss / len(traces)
        total = total + cfg.discard_weight * discard_term(logits, step_roots, events, normaliser, trace.sampling) / len(traces)
        batch = branch_batch(trace)
        if batch is None:
            continue
        total = total + cfg.branch_weight * branch_loss(_full_pass_branch_logits(head, trace, batch), target_rows, batch) / len(traces)
    return total


def _full_pass_branch_logits(head, trace, batch):
    """The branch logits as they were computed before the pass reused the unroll's keys and values: one
    tree-masked forward over the committed entries and the branch nodes together, read at the nodes."""
    c, nb = batch.committed, batch.ids.shape[1]
    mask = torch.zeros(c + nb, c + nb, dtype=torch.bool)
    mask[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    mask[c:] = batch.mask
    ids = torch.cat([trace.tokens[1 : c + 1].unsqueeze(0), batch.ids], 1)
    features = torch.cat([trace.features[:c].unsqueeze(0), batch.features], 1).float()
    positions = torch.cat([torch.arange(c).unsqueeze(0), batch.positions], 1)
    logits, _ = head(ids, head.fuse([features]), positions, tree_mask=mask.unsqueeze(0))
    return logits[0, c:]


def test_one_lm_head_pass_for_the_batch_gives_the_per_trace_loss_and_gradient(served, target):
    """flywheel_loss projects every trace's rows in one LM-head GEMM, and its branch pass reuses the unroll's
    keys and values: the same loss and gradients as one call per trace and unroll step with a full tree-masked
    branch pass (imitation, discard and branch terms all on)."""
    from tandem.flywheel.objective import flywheel_loss
    from tandem.flywheel.trainer import FlywheelConfig, target_lm_rows, trainer_copy
    from tandem.models.head_state import make_trainable

    head, traces = served
    head = make_trainable(trainer_copy(head))
    head.unpack()
    rows = target_lm_rows(target, head).float()
    cfg = FlywheelConfig(discard_weight=0.5, branch_weight=0.5)
    params = [p for p in head.parameters() if p.requires_grad]
    losses, grads = [], []
    for compute in (lambda g: flywheel_loss(head, rows, traces, cfg, g)[0], lambda g: _loss_trace_by_trace(head, rows, traces, cfg, g)):
        head.zero_grad(set_to_none=True)
        loss = compute(torch.Generator().manual_seed(0))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
    assert any(len(t.branch_token) for t in traces)  # the branch term ran
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_lookup_covered_counts_what_the_grafted_branch_drafts_right():
    """tokens 5 6 7 8 | 5 6 7 9: at root 4 (context ends 8 5) the lookup continues 6 7 8 5 after the earlier 5: the
    committed 6 7 match, 9 does not (2); at root 5 (... 5 6) it continues 7 8 5 6: 7 matches (1); at root 6 (... 6 7):
    8 5 6 7, the committed 9 does not (0); capped at `depth`."""
    from tandem.flywheel.objective import Lookup, covered_weights, lookup_covered

    tokens = [5, 6, 7, 8, 5, 6, 7, 9, 1]
    roots = torch.tensor([2, 3, 4, 5])  # at root 2 the context 5 6 7 8 has no earlier match of its suffix
    assert lookup_covered(tokens, roots, Lookup(k=4)).tolist() == [0, 2, 1, 0]
    assert lookup_covered(tokens, roots, Lookup(k=1)).tolist() == [0, 1, 1, 0]
    trace = type("T", (), {"tokens": torch.tensor(tokens)})()
    weights = covered_weights(trace, [roots, roots[1:3]], 0.25)  # step 0 over every root, step 1 over roots 3, 4
    assert [w.tolist() for w in weights] == [[[1.0, 0.25, 0.25, 1.0]], [[0.25, 1.0]]]


def test_covered_weight_zero_drops_the_covered_predictions_from_the_imitation(served, target):
    """With covered_weight 0 the imitation term is the mean over the predictions the lookup branch does not already
    make; with 1 it is the plain one; the two differ where some position is covered."""
    from tandem.flywheel.objective import covered_weights, flywheel_loss
    from tandem.flywheel.trainer import FlywheelConfig, target_lm_rows, trainer_copy

    from dataclasses import replace

    head, traces = served
    head = trainer_copy(head)
    rows = target_lm_rows(target, head).float()
    repeat = lambda t: torch.tensor([7, 8, 9, 10, 11]).repeat(len(t.tokens) // 5 + 1)[: len(t.tokens)]  # noqa: E731 - text the lookup finds
    traces = [replace(t, tokens=torch.cat([t.tokens[: t.prompt_len], repeat(t)[t.prompt_len :]])) for t in traces]
    loss = {w: flywheel_loss(head, rows, traces, FlywheelConfig(discard_weight=0.0, branch_weight=0.0, covered_weight=w), torch.Generator().manual_seed(0))[1]["imitation"]
            for w in (1.0, 0.0)}
    covered = sum(float((1 - w).sum()) for t in traces for w in covered_weights(t, [generated_roots(t)], 0.0))
    assert covered > 0 and loss[0.0] != pytest.approx(loss[1.0], rel=1e-6)
    with pytest.raises(Exception):
        FlywheelConfig(covered_weight=1.5)
