"""The flywheel's loss over SequenceTraces:

    L = [imitation] soft CE to the target over the committed sequence, with the training-time-test unroll
      + discard_weight * sum over evaluated proposals of r * -log(1 - q_theta(x)) / sum of r   (r: stop-gradient)
      + branch_weight  * soft CE to the target at drafted nodes off the accepted path (one tree-masked pass over the unroll's context)

The imitation term is offline training's (tandem.training.offline) on the request's own committed
tokens and target hidden states. A proposal at draft depth d whose chain began at committed position t
was drafted by unroll step d at root t: the discard term reads exactly that row, with q_theta the
distribution the drafter samples from for that request (temperature, top-k, top-p; the T = 1 softmax for
greedy). The branch pass runs the head at every branch node over the committed entries' keys and values
from the unroll's step 0 (they are the same entries): a branch
node sees the committed entries before the point where its branch left the accepted path, its own branch
ancestors and itself (teacher-forced with the target's hidden states at its parent).

Why the discard term is what it is. The verifier rejects x ~ q with r(x) = 1 - min(1, p(x)/q(x)) = max(0, q(x) - p(x)) / q(x),
so the expected rejected mass E_q[r] = sum_x max(0, q - p) = TV(p, q) = 1 - alpha: acceptance is lost exactly where the
drafter over-weights a token. The term estimates D(theta) = sum_x max(0, q(x) - p(x)) * l(x), l(x) = -log(1 - q_theta(x))
(unlikelihood: its gradient on x's logit is r * q_theta(x) > 0, zero where p >= q). As max(0, q - p) = q * r,
D = E_{x~q}[r l], and every proposal the verifier *evaluated* (a child of the root or of an accepted node, accepted or
not) is a draw from q: the estimator sums r * l over evaluated proposals, weighting each by r once (summing rejections
weighted by r again would estimate sum q r^2 l; tests/flywheel/test_objective.py checks the estimate against the exact
D). q and q_theta are the request's sampling transform (temperature, top-k, top-p) of the drafter's logits, the kept set
held fixed; greedy drafting makes q one-hot, r in {0, 1}, with q_theta the T = 1 softmax as a smooth surrogate. Each
trace's sum is divided by its sum of r (no gradient). A sibling tried after a rejected one in a tree faces the residual
distribution; plain r approximates it there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tandem.drafters.ngram import N_MAX, N_MIN
from tandem.errors import InvalidParameterError
from tandem.flywheel.traces import SequenceTrace
from tandem.models.cpu_gemm import product_nt
from tandem.models.eagle import EagleHead, target_to_draft
from tandem.flywheel.packing import packed_branch_hidden, packed_unroll
from tandem.models.eagle_train import lm_head_rows
from tandem.ops.losses import discard_loss, rejection_probability, soft_cross_entropy
from tandem.ops.ngram import ngram_candidates
from tandem.training.offline import Example, step_stats, target_states


def trace_example(trace: SequenceTrace) -> Example:
    """The committed part of a trace as an offline-training Example. The trace keeps final hidden states at
    generated positions only: prompt rows are zeros, which the flywheel loss never reads (its roots are
    generated ones); offline training from traces recomputes them (tandem.flywheel.trace_training)."""
    m = len(trace.features)
    prompt = min(trace.prompt_len, m)
    final = trace.final_hidden.float()
    final = torch.cat([final.new_zeros(m - len(final), final.shape[1]), final])
    return Example(trace.tokens[:m], trace.features.float(), final, trace.tokens[1 : m + 1], prompt)


@dataclass(frozen=True)
class Lookup:
    """The prompt-lookup branch `eagle_ngram` grafts onto the head's chain (tandem.drafters.hybrid): NgramDrafter's
    settings, its continuation of up to k tokens after the latest match of the context's longest suffix."""
    k: int = 4
    n_min: int = N_MIN
    n_max: int = N_MAX


def lookup_covered(tokens: list[int], roots: torch.Tensor, lookup: Lookup) -> torch.Tensor:  # [R] long
    """Per chain root t (the step whose pending token is t + 1): how many leading tokens of the committed continuation
    the prompt-lookup branch `eagle_ngram` grafts there drafts right (its continuation of up to `lookup.k` tokens of
    the context tokens[: t + 2], tandem.ops.ngram). The head's prediction at depth s < that adds nothing to what the
    deployed drafter accepts."""
    context = np.asarray(tokens)
    out = []
    for t in roots.tolist():
        found = ngram_candidates(context[: t + 2], lookup.n_min, lookup.n_max, lookup.k, 1)
        run = 0
        for token in found[0] if found else []:
            if t + 2 + run >= len(tokens) or tokens[t + 2 + run] != token:
                break
            run += 1
        out.append(run)
    return torch.tensor(out, dtype=torch.long)


def covered_weights(trace: SequenceTrace, step_roots: list[torch.Tensor], weight: float) -> list[torch.Tensor]:  # [1, R_s] per step
    """The imitation weight of each unroll step's predictions: `weight` where the lookup branch already drafts that
    depth right (lookup_covered), 1 elsewhere."""
    roots = torch.unique(torch.cat(step_roots))
    covered = dict(zip(roots.tolist(), lookup_covered(trace.tokens.tolist(), roots, Lookup(k=len(step_roots))).tolist()))  # drafted as deep as the unroll
    return [torch.tensor([[weight if s < covered[t] else 1.0 for t in root.tolist()]]) for s, root in enumerate(step_roots)]


def generated_roots(trace: SequenceTrace) -> torch.Tensor:  # [R] chain roots whose first draft token is generated output
    """Roots prompt_len - 1 .. M - 2: where the engine drafts (the prompt itself is never drafted)."""
    m = len(trace.features)
    first = min(max(trace.prompt_len - 1, 0), m - 2)
    return torch.arange(first, m - 1)


# ---- proposals the verifier evaluated ---------------------------------------------------------------------------
class Proposals(NamedTuple):
    root: torch.Tensor  # [E] long: committed position whose draft-cache entry began the chain
    depth: torch.Tensor  # [E] long
    token: torch.Tensor  # [E] long: draft-vocabulary id
    weight: torch.Tensor  # [E] float: r = 1 - min(1, p/q), the verifier's rejection probability


def evaluated_proposals(trace: SequenceTrace) -> Proposals:
    """Every drafted node the verifier evaluated (a child of the root or of an accepted node), accepted or
    not, with its rejection probability (target-vocabulary tokens)."""
    steps, parents = trace.node_step.tolist(), trace.node_parent.tolist()
    start, depth = {}, []
    for i, (step, parent) in enumerate(zip(steps, parents)):
        start.setdefault(step, i)
        depth.append(0 if parent < 0 else depth[start[step] + parent] + 1)
    parent_index = torch.tensor([start[s] + p if p >= 0 else -1 for s, p in zip(steps, parents)], dtype=torch.long)
    evaluated = (parent_index < 0) | trace.node_accepted[parent_index.clamp(min=0)] if len(steps) else torch.zeros(0, dtype=torch.bool)
    r = rejection_probability(trace.node_target_prob, trace.node_draft_prob)
    root = trace.step_root[trace.node_step] - 1 if len(steps) else torch.zeros(0, dtype=torch.long)
    return Proposals(root[evaluated], torch.tensor(depth, dtype=torch.long)[evaluated], trace.node_token[evaluated], r[evaluated])


def discard_events(trace: SequenceTrace, to_draft: torch.Tensor, unroll: int, roots: torch.Tensor) -> tuple[Proposals, float]:
    """The evaluated proposals the unroll can score with r > 0, and the normaliser sum(r) over them."""
    p = evaluated_proposals(trace)
    draft_ids = to_draft[p.token]
    keep = (p.depth < unroll) & (p.root >= roots[0]) & (p.root <= roots[-1]) & (draft_ids >= 0) & (p.weight > 0)
    kept = Proposals(p.root[keep], p.depth[keep], draft_ids[keep], p.weight[keep])
    return kept, float(kept.weight.sum())


def discard_term(logits: list[torch.Tensor], step_roots: list[torch.Tensor], events: Proposals, normaliser: float, sampling: tuple[float, int, float]) -> torch.Tensor:
    if len(events.root) == 0 or normaliser <= 0:
        return logits[0].sum() * 0.0
    rows, tokens, weights = [], [], []
    for s in events.depth.unique().tolist():
        at = events.depth == s
        rows.append(logits[s][0, torch.searchsorted(step_roots[s], events.root[at])])
        tokens.append(events.token[at])
        weights.append(events.weight[at])
    n = sum(len(t) for t in tokens)
    temperature, top_k, top_p = sampling
    return discard_loss(torch.cat(rows), torch.cat(tokens), torch.cat(weights).float(), torch.full((n,), float(temperature)),
                        torch.full((n,), int(top_k), dtype=torch.long), torch.full((n,), float(top_p)), normaliser=normaliser)


# ---- branches -------------------------------------------------------------------------------------------------
class BranchBatch(NamedTuple):
    ids: torch.Tensor  # [1, Nb] each branch node's token
    features: torch.Tensor  # [1, Nb, taps * d] unfused target features it reads (its parent's state)
    positions: torch.Tensor  # [1, Nb]
    mask: torch.Tensor  # [Nb, C + Nb] bool: which committed entries and which branch nodes each node sees
    committed: int  # C: the committed entries 0..C-1 are the context (step 0 of the unroll computed their keys and values)
    final: torch.Tensor  # [Nb, d] the target's final hidden state at each branch node


def branch_batch(trace: SequenceTrace) -> BranchBatch | None:
    """The branch nodes inside the committed length over the committed entries 0..C-1, with the tree mask: a
    node sees committed entries before its branch's top (the position where it left the accepted path:
    the committed entries from there on hold other tokens at the same positions), its ancestors, itself."""
    m = len(trace.features)
    keep = trace.branch_pos < m
    if not bool(keep.any()):
        return None
    index = torch.cumsum(keep.long(), 0) - 1  # new index of each kept branch node (a kept node's parent is kept: it has a lower position)
    parent = trace.branch_parent[keep]
    parent = torch.where(parent >= 0, index[parent.clamp(min=0)], parent)
    pos, token = trace.branch_pos[keep], trace.branch_token[keep]
    nb = len(pos)
    ancestors, top = torch.eye(nb, dtype=torch.bool), pos.clone()
    for i in range(nb):  # parents precede children
        if parent[i] >= 0:
            ancestors[i] |= ancestors[int(parent[i])]
            top[i] = top[int(parent[i])]
    committed = int(top.max())
    branch_feats = trace.features[pos]  # a node below a committed parent reads the committed state
    if bool((parent >= 0).any()):  # deeper nodes read their branch parent's (kept when branch_depth > 1)
        branch_feats = torch.where((parent >= 0).unsqueeze(1), trace.branch_features[keep][parent.clamp(min=0)], branch_feats)
    mask = torch.cat([torch.arange(committed).unsqueeze(0) < top.unsqueeze(1), ancestors], dim=1)
    return BranchBatch(token.unsqueeze(0), branch_feats.unsqueeze(0), pos.unsqueeze(0), mask, committed, trace.branch_final[keep])


def branch_loss(logits: torch.Tensor, target_rows: torch.Tensor, batch: BranchBatch, probs: torch.Tensor | None = None) -> torch.Tensor:
    """probs [Nb, Vd]: the target distribution at the nodes when the caller computed it (`target_distributions`)."""
    if probs is None:
        with torch.no_grad():
            probs = torch.softmax(product_nt(batch.final.float(), target_rows), dim=-1)
    return soft_cross_entropy(logits, probs)


@torch.no_grad()
def target_distributions(states: list[torch.Tensor], target_rows: torch.Tensor) -> list[torch.Tensor]:  # [..., d] each -> [..., Vd] each
    """The target's distributions over the draft vocabulary at many tensors of final hidden states in one GEMM:
    the [Vd, d] rows are read once per trainer step, not once per trace and term."""
    rows = torch.cat([h.reshape(-1, h.shape[-1]).float() for h in states])
    out = torch.softmax(product_nt(rows, target_rows), dim=-1).split([h[..., 0].numel() for h in states])
    return [o.view(*h.shape[:-1], o.shape[-1]) for o, h in zip(out, states)]


# ---- the whole loss ---------------------------------------------------------------------------------------------
class TracePlan(NamedTuple):
    """One trace's part of a batch: what its loss terms read once the LM head has projected every row."""

    trace: SequenceTrace
    example: Example
    events: Proposals  # the proposals the discard term scores
    normaliser: float  # their sum of rejection weights
    step_roots: list[torch.Tensor]  # the roots of each unroll step
    branch: BranchBatch | None
    rows: slice  # its tensors in the batch's list of normed hidden states (the unroll steps, then the branch nodes)


def flywheel_loss(head: EagleHead, target_rows: torch.Tensor, traces: list[SequenceTrace], cfg, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Mean over traces of the switched-on terms (cfg: a FlywheelConfig). A trace's step-0 logits are read at its
    generated positions only, and its chains are a `chain_fraction` sample of them plus every root a scored
    proposal past depth 0 needs. The traces are packed end to end (tandem.flywheel.packing: no padding, each
    attends within itself), so the layer runs once per unroll step for the whole batch and once more for every
    trace's branch nodes; the LM head runs once over every row (eagle_train.lm_head_rows), and the target's
    distributions for every trace and term come from one pass over `target_rows`."""
    traces = [t for t in traces if len(t.features) >= 2]
    if not traces:
        raise InvalidParameterError("no trace in the batch has two committed positions")
    to_draft = target_to_draft(head.draft_to_target.cpu(), head.cfg.target_vocab_size)
    examples, firsts, chains, drafted = [], [], [], []
    for trace in traces:
        roots = generated_roots(trace)
        events, normaliser = discard_events(trace, to_draft, cfg.unroll, roots)
        sampled = roots[torch.randperm(len(roots), generator=generator)[: max(1, math.ceil(cfg.chain_fraction * len(roots)))]]
        examples.append(trace_example(trace))
        firsts.append(roots)
        chains.append(torch.unique(torch.cat([sampled, events.root[events.depth > 0]])))
        drafted.append((events, normaliser))
    packed = packed_unroll(head, examples, cfg.unroll, chains, firsts)
    branch_batches = [branch_batch(t) if cfg.branch_weight > 0 and len(t.branch_token) else None for t in traces]
    branch_states = packed_branch_hidden(head, branch_batches, packed)
    plans, normed = [], []
    for trace, example, first, chain, (events, normaliser), branch, hidden, extra in zip(traces, examples, firsts, chains, drafted, branch_batches, packed.hidden, branch_states):
        hidden = hidden + ([extra] if extra is not None else [])
        step_roots = [first] + [chain] * (cfg.unroll - 1)
        plans.append(TracePlan(trace, example, events, normaliser, step_roots, branch, slice(len(normed), len(normed) + len(hidden))))
        normed += hidden
    projected = lm_head_rows(head, normed)  # one LM-head GEMM for the whole batch
    states = ([target_states([p.example], p.step_roots) for p in plans] if cfg.imitation else []) + [p.branch.final for p in plans if p.branch is not None]
    distributions = target_distributions(states, target_rows) if states else []
    imitation, branches = distributions[: len(plans) if cfg.imitation else 0], iter(distributions[len(plans) if cfg.imitation else 0 :])
    totals: dict[str, torch.Tensor] = {}
    rejections = 0
    for i, plan in enumerate(plans):
        logits = projected[plan.rows]
        if plan.branch is not None:
            logits, branch_rows = logits[:-1], logits[-1]
        rejections += len(plan.events.root)
        parts = {}
        if cfg.imitation:
            weights = covered_weights(plan.trace, plan.step_roots, cfg.covered_weight) if cfg.covered_weight < 1.0 else None
            parts["imitation"] = step_stats([plan.example], target_rows, logits, plan.step_roots, head.draft_to_target, imitation[i], weights).loss
        if cfg.discard_weight > 0:
            parts["discard"] = cfg.discard_weight * discard_term(logits, plan.step_roots, plan.events, plan.normaliser, plan.trace.sampling)
        if plan.branch is not None:
            parts["branch"] = cfg.branch_weight * branch_loss(branch_rows, target_rows, plan.branch, next(branches))
        elif cfg.branch_weight > 0 and len(plan.trace.branch_token):
            parts["branch"] = head.fc.weight.sum() * 0.0
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value / len(traces)
    loss = sum(totals.values())
    return loss, {k: float(v.detach()) for k, v in totals.items()} | {"rejections": rejections}
