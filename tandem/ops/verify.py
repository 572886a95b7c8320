"""Lossless verification of a draft (chain or tree) against the target: speculative rejection sampling
(`verify_chain`, `verify_tree`), or comparison with the target's own tokens (`verify_tokens`: greedy, and
seeded sampling, whose draws do not depend on the draft).

Inputs follow `tandem.ops.tree`: nodes in topological order, `target_probs[0]` is the target's sampling
distribution at the root (after the last committed token) and `target_probs[i + 1]` the one after node
i, both from `sampling_probs`, so temperature / top-k / top-p are already applied and greedy is a
one-hot row. `draft_probs[i]` is the distribution node i's token was actually drawn from, conditioned on
everything drafted before it (earlier nodes in index order). A deterministic drafter (argmax, top-k
children, n-gram lookup) reports a one-hot row. Randomness is passed in as uniforms in [0, 1):
`uniform[i]` decides node i, `uniform[N]` samples the final (recovered or bonus) token.

Accepting token x "with probability min(1, target(x) / draft(x))" is tested as
`target(x) > 0 and (target(x) >= draft(x) or u * draft(x) < target(x))`, which never divides. A token
the target gives probability 0 is never accepted; a drafted token the drafter claims it drew with
probability 0 (a drafter bug: that row is not the distribution it sampled from) is treated as ratio
+inf, i.e. accepted iff the target allows it. The output is then no longer guaranteed lossless (the
drafter lied) but it stays well defined and never emits a token the target excludes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.errors import InvalidParameterError
from tandem.ops.sampling import sample_from_probs
from tandem.ops.tree import children, validate_parents
from tandem.types import VerifyResult


def accepts(
    target_prob: torch.Tensor,  # [...] target-side probability of the drafted token
    draft_prob: torch.Tensor,  # [...] probability the drafter drew it with
    uniform: torch.Tensor,  # [...] in [0, 1)
) -> torch.Tensor:  # [...] bool
    """The acceptance test `uniform < target_prob / draft_prob`, without dividing (see module doc)."""
    u = uniform.to(device=draft_prob.device, dtype=draft_prob.dtype)
    return (target_prob > 0) & ((target_prob >= draft_prob) | (u * draft_prob < target_prob))


def residual_probs(
    target_probs: torch.Tensor,  # [..., V] target-side distribution (a target row or a residual)
    draft_probs: torch.Tensor,  # [..., V] the rejected proposal
) -> torch.Tensor:  # [..., V]
    """normalize(max(0, target - draft)), the distribution to draw from after rejecting `draft`.

    A row with no residual mass (target == draft, so a rejection has probability 0) falls back to
    `target_probs`, the limit of the residual as draft -> target.
    """
    diff = (target_probs - draft_probs).clamp(min=0)
    mass = diff.sum(-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp(min=torch.finfo(diff.dtype).tiny), target_probs)


def verify_chain(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor,  # [k, V]
    target_probs: torch.Tensor,  # [k + 1, V]
    uniform: torch.Tensor,  # [k + 1] in [0, 1)
) -> VerifyResult:
    """Standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023) of a chain of k tokens.

    Drafted token i is accepted iff it passes `accepts(...)` with uniform[i] and all earlier ones did.
    At the first rejection j the recovered token is drawn from residual_probs(target[j], draft[j]);
    if all k are accepted the bonus token is drawn from target[k]; either with uniform[k].
    """
    k = draft_tokens.numel()
    _check_draft(draft_tokens, draft_probs, target_probs, uniform)
    token_list = draft_tokens.tolist()
    _check_tokens(token_list, draft_probs.shape[-1])
    idx = torch.arange(k, device=draft_tokens.device)
    passed = accepts(target_probs[idx, draft_tokens], draft_probs[idx, draft_tokens], uniform[:k])
    num_accepted = int(passed.long().cumprod(0).sum())  # length of the all-accepted prefix
    if num_accepted == k:
        final_probs = target_probs[k]
    else:
        final_probs = residual_probs(target_probs[num_accepted], draft_probs[num_accepted])
    final = _sample_one(final_probs, uniform[k])
    accepted = list(range(num_accepted))
    return VerifyResult(accepted, token_list[:num_accepted] + [final], k, bonus=num_accepted == k)


def verify_tree(
    parents: torch.Tensor,  # [N] long, topological, -1 = child of the root
    tokens: torch.Tensor,  # [N] long
    draft_probs: torch.Tensor,  # [N, V]
    target_probs: torch.Tensor,  # [N + 1, V]; row 0 = root, row i + 1 = after node i
    uniform: torch.Tensor,  # [N + 1] in [0, 1)
) -> VerifyResult:
    """Multi-candidate recursive rejection sampling over a draft tree (SpecInfer, Miao et al. 2024).

    Walk down from the root. At the current node, with residual r (initially the target row of that
    node), try its children c in index order: accept c iff `accepts(r(x_c), d_c(x_c), uniform[c])`
    with d_c = draft_probs[c]; on acceptance move to c (r = target row of c); on rejection set
    r <- residual_probs(r, d_c) and try the next child. When every child was rejected, or the node is
    a leaf (the whole path was accepted: a bonus), draw the final token from r with uniform[N].

    Why this is lossless: at one node, a child whose token x ~ d_c (given everything before it) is
    emitted with probability d_c(x) * min(1, r(x)/d_c(x)) = min(r(x), d_c(x)); it is rejected with
    probability 1 - sum_x min(r, d_c) = sum_x max(0, r - d_c) = m. If whatever follows a rejection
    emits x with probability r'(x) = max(0, r(x) - d_c(x)) / m, the total is
    min(r, d_c) + max(0, r - d_c) = r(x). That holds by induction over the remaining siblings, the
    base case being the final draw from r itself. So the token emitted at each depth is distributed
    exactly as the target given the emitted prefix, and after accepting c the walk continues from the
    target row after c, which is the target's conditional for the next token. Nothing here assumes the
    siblings are distinct or random: duplicate tokens, or one-hot (deterministic) proposals, only
    change d_c, and the identity holds for any d_c the child's token was truly drawn from. On a chain
    every node has one child and this is exactly `verify_chain`, uniform for uniform.
    """
    validate_parents(parents)
    n = parents.numel()
    _check_draft(tokens, draft_probs, target_probs, uniform)
    token_list = tokens.tolist()
    _check_tokens(token_list, draft_probs.shape[-1])
    idx = torch.arange(n, device=tokens.device)
    parent_rows = parents.to(tokens.device) + 1
    # A node's decision when it is the first child tried at its parent, where r is still the target row.
    first_try = accepts(target_probs[parent_rows, tokens], draft_probs[idx, tokens], uniform[:n]).tolist()
    kids = children(parents)
    row, accepted = 0, []
    while True:
        child, final_probs = _try_children(kids[row], target_probs[row], first_try, token_list, draft_probs, uniform)
        if child is None:
            break
        accepted.append(child)
        row = child + 1
    final = _sample_one(final_probs, uniform[n])
    return VerifyResult(accepted, [token_list[c] for c in accepted] + [final], n, bonus=not kids[row])


def _try_children(
    candidates: list[int],  # children of the current node, in the order they are tried
    target_row: torch.Tensor,  # [V] target distribution at the current node
    first_try: list[bool],  # [N] acceptance of each node against its parent's target row
    token_list: list[int],  # [N]
    draft_probs: torch.Tensor,  # [N, V]
    uniform: torch.Tensor,  # [N + 1]
) -> tuple[int | None, torch.Tensor]:
    """Rejection sampling among one node's children: (accepted child, _) or (None, final residual)."""
    residual = target_row
    for tried, c in enumerate(candidates):
        x = token_list[c]
        ok = first_try[c] if tried == 0 else bool(accepts(residual[x], draft_probs[c, x], uniform[c]))
        if ok:
            return c, residual
        residual = residual_probs(residual, draft_probs[c])
    return None, residual


def _sample_one(probs: torch.Tensor, uniform: torch.Tensor) -> int:  # probs: [V], uniform: []
    return int(sample_from_probs(probs.unsqueeze(0), uniform.reshape(1).to(probs.device))[0])


def _check_draft(
    tokens: torch.Tensor,  # [N]
    draft_probs: torch.Tensor,  # [N, V]
    target_probs: torch.Tensor,  # [N + 1, V]
    uniform: torch.Tensor,  # [N + 1]
) -> None:
    n = tokens.numel()
    ok = (
        tokens.dim() == 1
        and draft_probs.dim() == 2
        and target_probs.dim() == 2
        and draft_probs.shape[0] == n
        and target_probs.shape[0] == n + 1
        and draft_probs.shape[1] == target_probs.shape[1]
        and uniform.shape == (n + 1,)
    )
    if not ok:
        raise InvalidParameterError(
            f"draft shapes disagree: tokens {tuple(tokens.shape)}, draft_probs {tuple(draft_probs.shape)}, "
            f"target_probs {tuple(target_probs.shape)}, uniform {tuple(uniform.shape)}; expected "
            "[N], [N, V], [N + 1, V], [N + 1]"
        )


def _check_tokens(token_list: list[int], vocab: int) -> None:
    bad = [t for t in token_list if not 0 <= t < vocab]
    if bad:
        raise InvalidParameterError(f"drafted token ids {bad} are outside the vocabulary [0, {vocab})")


def verify_tokens(
    parents: torch.Tensor,  # [N] long, topological, -1 = child of the root
    tokens: torch.Tensor,  # [N] long
    own_token: Callable[[int], int],  # row -> the target's own token at the root (row 0) or after node i (row i + 1)
) -> VerifyResult:
    """Accept, from the root down, the child whose token is the target's own token at its parent; emit the
    target's token where no child has it. Without any [*, V] tensor; `own_token` is asked only for the rows
    the walk reaches.

    The target's own token is its argmax (greedy), or its draw from a seeded request's keyed exponentials
    (`ops.sampling.keyed_sample`), which depends on the position and the tokens before it, never on the draft: the
    emitted tokens are the ones decoding without a draft draws, bit for bit, so this is lossless for any
    drafter. On a greedy target it is `verify_tree` with one-hot target rows: a child is accepted iff its token
    is the argmax (target(x) = 1 >= any draft(x)), a rejection leaves the residual one-hot on the argmax, and
    the final token is the argmax of the last accepted node.
    """
    token_list = tokens.tolist()
    kids = children(parents)
    row, accepted = 0, []
    while True:
        best = own_token(row)
        match = next((c for c in kids[row] if token_list[c] == best), None)
        if match is None:
            break
        accepted.append(match)
        row = match + 1
    return VerifyResult(accepted, [token_list[c] for c in accepted] + [best], len(token_list), bonus=not kids[row])
