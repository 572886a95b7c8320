"""Speculative verification: unit cases, chain/tree parity, greedy exactness and losslessness.

Losslessness harness: a Markov "target" over a tiny vocabulary (sharp, flat and partly-zero rows,
transformed by `sampling_probs`) and a different Markov "draft" table. Each sample decodes
speculatively from START (draft with some drafter, take target rows given each drafted prefix, verify,
commit the emitted tokens, repeat) until L tokens are out; the empirical law of those L tokens
(V**L cells) must match the exact target Markov law. Drafting is vectorised over samples; only the
verify call under test runs per sample.

Statistical checks, per call of `_assert_lossless`:
- no sample ever lands in a cell of exact probability 0 (deterministic, no false failures);
- Pearson chi-square (cells of expected count < 5 pooled), fails when its p-value < 1e-4: false-failure
  probability 1e-4 (asymptotic chi-square law);
- total variation <= E-bound + McDiarmid deviation at delta = 1e-4: false-failure probability <= 1e-4
  (non-asymptotic: E|c_i/n - p_i| <= sqrt(p_i (1 - p_i) / n), and TV has bounded differences 1/n).
With 7 lossless scenarios the whole file fails falsely with probability < 1.5e-3; all seeds are fixed,
so a given torch/numpy build either always passes or always fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import tandem.ops.verify as verify_mod
from tandem.errors import InvalidParameterError
from tandem.ops.sampling import sampling_probs
from tandem.ops.tree import chain_parents, path_to
from tandem.ops.verify import residual_probs, verify_chain, verify_tree

# ---------------------------------------------------------------------------- the synthetic models

V = 5
L = 3  # tokens compared per sample
START = 0  # last committed token before decoding
NUM_SAMPLES = 1500  # per scenario; the negative controls below show this is plenty of power
ALPHA = 1e-4  # false-failure probability of each statistical check
NEG = -math.inf
TARGET_LOGITS = torch.tensor([  # [V, V] target logits given the previous token; -inf = probability 0
    [0.0, 0.2, -0.1, 0.1, NEG],  # flat-ish, one zero
    [3.0, -1.0, NEG, -0.5, -2.0],  # sharp
    [0.5, 0.5, 0.5, 0.5, 0.5],  # uniform
    [NEG, 1.0, 0.0, NEG, 2.0],  # two zeros
    [1.5, NEG, 0.2, 1.0, -0.3],
])
DRAFT_TABLE = np.array([  # [V, V] draft probs given the previous token; deliberately unlike the target
    [0.1, 0.1, 0.1, 0.2, 0.5],  # favours a token the target forbids
    [0.4, 0.3, 0.3, 0.0, 0.0],  # cannot propose tokens 3, 4; proposes the forbidden 2
    [0.7, 0.1, 0.1, 0.1, 0.0],  # sharp where the target is flat
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.0, 0.5, 0.0, 0.5, 0.0],
])


def _target_table(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:  # [V, V]
    probs = sampling_probs(
        TARGET_LOGITS,
        torch.full((V,), temperature),
        torch.full((V,), top_k, dtype=torch.long),
        torch.full((V,), top_p),
    )
    return probs.double().numpy()


def _exact_law(table: np.ndarray) -> np.ndarray:  # [V] * L, the target Markov law of L tokens
    law = table[START]
    for _ in range(L - 1):
        law = np.einsum("...i,ij->...ij", law, table)  # P(x_1..x_t, x_t+1) = P(x_1..x_t) T[x_t, x_t+1]
    return law / law.sum()


# ---------------------------------------------------------------------------- drafters (vectorised)


@dataclass(frozen=True)
class Drafter:
    """A fixed tree shape and how each node's token is drawn from the draft row of its parent's token.

    kinds: "sample" (i.i.d. from the row), "distinct" (from the row without the tokens of earlier
    siblings, renormalised; reports that conditional), or an int r (one-hot on the r-th most likely
    token of the row: a deterministic top-k / greedy drafter).
    """

    parents: tuple[int, ...]
    kinds: tuple[object, ...]

    def draft(self, last: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """last: [S] -> tokens [S, N], draft_probs [S, N, V]."""
        num, n = len(last), len(self.parents)
        tokens = np.zeros((num, n), dtype=np.int64)
        probs = np.zeros((num, n, V))
        for i, (parent, kind) in enumerate(zip(self.parents, self.kinds)):
            row = DRAFT_TABLE[last if parent < 0 else tokens[:, parent]]  # [S, V]
            probs[:, i] = self._proposal(i, kind, row, tokens)
            cdf = probs[:, i].cumsum(-1)
            draws = (rng.random(num)[:, None] * cdf[:, -1:] >= cdf).sum(-1)
            tokens[:, i] = np.minimum(draws, V - 1)
        return tokens, probs

    def _proposal(self, i: int, kind: object, row: np.ndarray, tokens: np.ndarray) -> np.ndarray:  # [S, V]
        if kind == "sample":
            return row
        if kind == "distinct":
            siblings = [j for j in range(i) if self.parents[j] == self.parents[i]]
            kept = row.copy()
            kept[np.arange(len(row))[:, None], tokens[:, siblings]] = 0.0
            assert (kept.sum(-1) > 0).all(), "test drafter bug: no mass left for a distinct sibling"
            return kept / kept.sum(-1, keepdims=True)
        ranked = np.argsort(-row, axis=-1, kind="stable")[:, kind]
        return np.eye(V)[ranked]


def _chain(kind: object, k: int) -> Drafter:
    return Drafter(tuple(range(-1, k - 1)), (kind,) * k)


# ---------------------------------------------------------------------------- the decoding loop


def _chain_verifier(parents, tokens, draft_probs, target_probs, uniform):
    return verify_chain(tokens, draft_probs, target_probs, uniform)


def _decode(drafter: Drafter, table: np.ndarray, verifier, num: int, seed: int) -> np.ndarray:  # [num, L]
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor(drafter.parents, dtype=torch.long)
    out = np.zeros((num, L), dtype=np.int64)
    count = np.zeros(num, dtype=np.int64)
    last = np.full(num, START)
    active = np.arange(num)
    while active.size:
        tokens, draft_probs = drafter.draft(last[active], rng)
        target_rows = table[np.concatenate([last[active, None], tokens], axis=1)]  # [S, N + 1, V]
        uniforms = torch.rand(active.size, len(drafter.parents) + 1, generator=gen)
        tokens_t, draft_t = torch.from_numpy(tokens), torch.from_numpy(draft_probs).float()
        target_t = torch.from_numpy(target_rows).float()
        for j, s in enumerate(active.tolist()):
            emitted = verifier(parents, tokens_t[j], draft_t[j], target_t[j], uniforms[j]).tokens
            take = emitted[: L - count[s]]
            out[s, count[s] : count[s] + len(take)] = take
            count[s] += len(take)
            last[s] = emitted[-1]
        active = active[count[active] < L]
    return out


# ---------------------------------------------------------------------------- the statistics


def _fit(samples: np.ndarray, law: np.ndarray) -> dict[str, float]:
    """Chi-square p-value, TV distance and its (1 - ALPHA) bound, and the mass on impossible cells."""
    num = len(samples)
    counts = np.bincount(np.ravel_multi_index(samples.T, law.shape), minlength=law.size).astype(float)
    probs = law.ravel()
    expected = probs * num
    big = expected >= 5
    observed_bins = np.append(counts[big], counts[~big].sum())
    expected_bins = np.append(expected[big], expected[~big].sum())
    if expected_bins[-1] == 0:
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    stat = float(((observed_bins - expected_bins) ** 2 / np.maximum(expected_bins, 1e-300)).sum())
    dof = len(expected_bins) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * float(np.abs(counts / num - probs).sum())
    tv_bound = 0.5 * float(np.sqrt(probs * (1 - probs) / num).sum()) + math.sqrt(math.log(1 / ALPHA) / (2 * num))
    impossible = float(counts[probs == 0].sum())
    return {"pvalue": pvalue, "stat": stat, "dof": dof, "tv": tv, "tv_bound": tv_bound, "impossible": impossible}


def _assert_lossless(samples: np.ndarray, law: np.ndarray) -> None:
    fit = _fit(samples, law)
    assert fit["impossible"] == 0, fit
    assert fit["pvalue"] > ALPHA, fit
    assert fit["tv"] <= fit["tv_bound"], fit


# ---------------------------------------------------------------------------- losslessness

TREE_SAMPLED = Drafter((-1, -1, -1, 0, 0, 1, 1, 2, 2), ("sample",) * 9)  # 3 x 2, i.i.d.: duplicates
TREE_TOP_K = Drafter((-1, -1, 0, 0, 1, 1, 2, 4), (0, 1, 0, 1, 0, 1, 0, 0))  # deterministic top-2, depth 3
TREE_MIXED = Drafter(  # duplicate one-hot siblings, a sampled sibling, a sampled-without-replacement one
    (-1, -1, -1, 0, 0, 0, 1, 3),
    (0, 0, "sample", "sample", "distinct", 0, "sample", 0),
)

LOSSLESS_CASES = {
    "chain-k1": (_chain("sample", 1), {}, _chain_verifier),
    "chain-k2-t0.8-p0.9": (_chain("sample", 2), {"temperature": 0.8, "top_p": 0.9}, _chain_verifier),
    "chain-k4": (_chain("sample", 4), {}, _chain_verifier),
    "chain-greedy-draft-k3-topk3": (_chain(0, 3), {"top_k": 3}, _chain_verifier),
    "tree-sampled": (TREE_SAMPLED, {}, verify_tree),
    "tree-top-k-t0.8-p0.9": (TREE_TOP_K, {"temperature": 0.8, "top_p": 0.9}, verify_tree),
    "tree-mixed-t1.3-topk3": (TREE_MIXED, {"temperature": 1.3, "top_k": 3}, verify_tree),
}


def _check_case(name: str, num: int) -> None:
    drafter, transform, verifier = LOSSLESS_CASES[name]
    table = _target_table(**transform)
    samples = _decode(drafter, table, verifier, num, seed=sum(map(ord, name)))
    _assert_lossless(samples, _exact_law(table))


@pytest.mark.parametrize("name", list(LOSSLESS_CASES))
def test_speculative_decoding_is_lossless(name):
    _check_case(name, NUM_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOSSLESS_CASES))
def test_speculative_decoding_is_lossless_many_samples(name):
    """The same check with 15x the samples: more power against small biases, same false-failure rate."""
    _check_case(name, 15 * NUM_SAMPLES)


def _accept_always(target_prob, draft_prob, uniform):
    return torch.ones_like(target_prob, dtype=torch.bool)


def _no_residual(target_probs, draft_probs):
    return target_probs


@pytest.mark.parametrize(
    ("name", "attr", "bug"),
    [
        ("chain-k2-t0.8-p0.9", "accepts", _accept_always),
        ("chain-k1", "residual_probs", _no_residual),
        ("tree-sampled", "residual_probs", _no_residual),
    ],
)
def test_negative_control_has_power(name, attr, bug, monkeypatch):
    """A wrong verifier must fail the same check, by a wide margin (else the check proves nothing).

    Bugs: accepting every drafted token; drawing the recovered token (and, in trees, testing later
    siblings) from the target row instead of the residual. The threshold 1e-12 sits far below ALPHA;
    these bugs measured p-values of 1e-30 to 1e-175 at this sample size, so a pass here is not luck.
    """
    monkeypatch.setattr(verify_mod, attr, bug)
    drafter, transform, verifier = LOSSLESS_CASES[name]
    table = _target_table(**transform)
    fit = _fit(_decode(drafter, table, verifier, NUM_SAMPLES, seed=7), _exact_law(table))
    assert fit["pvalue"] < 1e-12, fit


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    ("drafter", "verifier"),
    [(_chain("sample", 3), _chain_verifier), (_chain(0, 2), _chain_verifier), (TREE_SAMPLED, verify_tree), (TREE_MIXED, verify_tree)],
    ids=["chain-sampled", "chain-argmax", "tree-sampled", "tree-mixed"],
)
def test_greedy_output_is_token_identical_to_plain_greedy(drafter, verifier):
    table = _target_table(temperature=0.0)
    greedy, token = [], START
    for _ in range(L):
        token = int(table[token].argmax())
        greedy.append(token)
    samples = _decode(drafter, table, verifier, 200, seed=3)
    assert (samples == np.array(greedy)).all()


def test_greedy_accepts_exactly_the_argmax_prefix():
    target = torch.eye(6)[[2, 4, 1, 0]]  # one-hot target rows: argmax 2, 4, 1, 0
    draft_tokens = torch.tensor([2, 4, 3])
    draft_probs = torch.stack([torch.eye(6)[2], torch.full((6,), 1 / 6), torch.eye(6)[3]])
    for u in torch.rand(50, 4, generator=torch.Generator().manual_seed(0)).unbind():
        result = verify_chain(draft_tokens, draft_probs, target, u)
        assert result.tokens == [2, 4, 1] and result.accepted_nodes == [0, 1] and not result.bonus


def test_greedy_never_divides_by_zero_when_draft_covers_only_the_argmax():
    # Buggy drafter: claims a one-hot on the argmax but drafted another token (draft prob 0, target 0).
    # The residual max(0, target - draft) is all zero, so the fallback (the target row) decides.
    target = torch.eye(4)[[1, 1]]
    result = verify_chain(torch.tensor([3]), torch.eye(4)[[1]], target, torch.tensor([0.5, 0.5]))
    assert result.tokens == [1] and result.num_accepted == 0


# ---------------------------------------------------------------------------- chain unit cases


def test_chain_accepts_prefix_then_recovers_from_residual():
    target = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])  # [k + 1, V]
    draft = torch.tensor([[0.5, 0.5, 0.0], [0.8, 0.1, 0.1]])  # [k, V]
    tokens = torch.tensor([1, 0])
    # Node 0: target == draft, always accepted. Node 1: ratio 0.2 / 0.8 = 0.25; u = 0.3 rejects.
    # Residual max(0, [0.2, 0.3, 0.5] - [0.8, 0.1, 0.1]) = [0, 0.2, 0.4] -> [0, 1/3, 2/3]; u = 0.2 -> 1.
    result = verify_chain(tokens, draft, target, torch.tensor([0.99, 0.3, 0.2]))
    assert result.accepted_nodes == [0] and result.tokens == [1, 1] and not result.bonus
    assert result.num_drafted == 2 and result.num_accepted == 1
    # u = 0.2 < 0.25 accepts node 1 too; the bonus comes from the last target row.
    result = verify_chain(tokens, draft, target, torch.tensor([0.99, 0.2, 0.7]))
    assert result.tokens == [1, 0, 0] and result.bonus


def test_empty_chain_samples_the_target_row():
    target = torch.tensor([[0.0, 1.0, 0.0]])
    result = verify_chain(torch.empty(0, dtype=torch.long), torch.empty(0, 3), target, torch.tensor([0.4]))
    assert result.tokens == [1] and result.bonus and result.num_drafted == 0
    assert verify_tree(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0, 3), target, torch.tensor([0.4])) == result


def test_drafted_token_with_zero_draft_probability_is_safe():
    """Drafter bug guard: draft(x) == 0 acts as ratio +inf, but never emits a target-zero token."""
    draft = torch.tensor([[0.0, 1.0, 0.0]])
    allowed = torch.tensor([[0.6, 0.0, 0.4], [0.0, 0.0, 1.0]])
    result = verify_chain(torch.tensor([0]), draft, allowed, torch.tensor([0.999, 0.1]))
    assert result.accepted_nodes == [0] and result.tokens == [0, 2]
    forbidden = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    for u in torch.linspace(0, 0.999, 21):
        result = verify_chain(torch.tensor([0]), draft, forbidden, torch.tensor([u, u]))
        assert result.num_accepted == 0 and result.tokens[0] == 2  # residual [0, 0, 0.5] -> token 2


def test_residual_probs():
    target = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.25, 0.25, 0.5]])
    draft = torch.tensor([[0.5, 0.5, 0.0], [0.8, 0.1, 0.1], [0.0, 0.0, 1.0]])
    expected = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1 / 3, 2 / 3], [0.5, 0.5, 0.0]])  # row 0: no mass -> target
    torch.testing.assert_close(residual_probs(target, draft), expected)
    assert torch.isfinite(residual_probs(target, target)).all()


def test_invalid_inputs_raise():
    target, draft, uniform = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25), torch.rand(3)
    with pytest.raises(InvalidParameterError):
        verify_chain(torch.tensor([0, 1]), draft, target[:2], uniform)
    with pytest.raises(InvalidParameterError):
        verify_chain(torch.tensor([0, 1]), draft, target, uniform[:2])
    with pytest.raises(InvalidParameterError):
        verify_chain(torch.tensor([0, 4]), draft, target, uniform)
    with pytest.raises(InvalidParameterError):
        verify_tree(torch.tensor([-1, 1]), torch.tensor([0, 1]), draft, target, uniform)


# ---------------------------------------------------------------------------- tree unit cases


def test_duplicate_one_hot_siblings_stay_exact():
    # Two deterministic siblings both drafting token 1 (target 0.5). The first is accepted iff u < 0.5;
    # once it is rejected the residual has no mass on 1, so the duplicate can never be accepted.
    parents, tokens = torch.tensor([-1, -1]), torch.tensor([1, 1])
    draft = torch.eye(3)[[1, 1]]
    target = torch.tensor([[0.25, 0.5, 0.25], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    result = verify_tree(parents, tokens, draft, target, torch.tensor([0.4, 0.0, 0.5]))
    assert result.accepted_nodes == [0] and result.tokens == [1, 0] and result.bonus
    result = verify_tree(parents, tokens, draft, target, torch.tensor([0.6, 0.0, 0.4]))
    assert result.accepted_nodes == [] and result.tokens == [0]  # residual [0.5, 0, 0.5], u = 0.4
    result = verify_tree(parents, tokens, draft, target, torch.tensor([0.6, 0.0, 0.6]))
    assert result.tokens == [2]


def test_second_sibling_is_tested_against_the_residual():
    parents, tokens = torch.tensor([-1, -1]), torch.tensor([0, 2])
    draft = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    target = torch.tensor([[0.5, 0.2, 0.3], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    # Reject child 0 (u = 0.7 >= 0.5): residual [0, 0.4, 0.6]. Child 1 (token 2): 0.59 < 0.6 accepts,
    # although it would be rejected against the fresh target row (0.3).
    result = verify_tree(parents, tokens, draft, target, torch.tensor([0.7, 0.59, 0.1]))
    assert result.accepted_nodes == [1] and result.tokens == [2, 1] and result.bonus


def _random_case(gen: torch.Generator, n: int, vocab: int, chain: bool):
    """A random draft with zeros and one-hot rows, for parity and structure checks."""
    if chain:
        parents = chain_parents(n)
    else:
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)], dtype=torch.long)

    def rows(count: int) -> torch.Tensor:
        probs = torch.rand(count, vocab, generator=gen) ** 3 * (torch.rand(count, vocab, generator=gen) > 0.3)
        probs[:, 0] += 1e-3  # every row keeps some mass
        one_hot = torch.rand(count, generator=gen) < 0.3
        probs[one_hot] = torch.eye(vocab)[probs[one_hot].argmax(-1)]
        return probs / probs.sum(-1, keepdim=True)

    draft = rows(n)
    tokens = torch.multinomial(draft, 1, generator=gen).squeeze(-1) if n else torch.empty(0, dtype=torch.long)
    return parents, tokens, draft, rows(n + 1), torch.rand(n + 1, generator=gen)


def test_tree_with_chain_parents_equals_verify_chain():
    gen = torch.Generator().manual_seed(11)
    for case in range(400):
        parents, tokens, draft, target, uniform = _random_case(gen, case % 6, 2 + case % 5, chain=True)
        assert verify_tree(parents, tokens, draft, target, uniform) == verify_chain(tokens, draft, target, uniform)


def test_tree_result_is_a_path_ending_in_recovered_or_bonus():
    gen = torch.Generator().manual_seed(12)
    for case in range(200):
        parents, tokens, draft, target, uniform = _random_case(gen, 1 + case % 8, 4, chain=False)
        result = verify_tree(parents, tokens, draft, target, uniform)
        last = result.accepted_nodes[-1] if result.accepted_nodes else -1
        assert result.accepted_nodes == path_to(last, parents)
        assert result.tokens[:-1] == tokens[result.accepted_nodes].tolist()
        assert result.bonus == (last not in parents.tolist())  # bonus iff the path ends at a leaf
        assert target[last + 1, result.tokens[-1]] > 0  # residuals stay inside the target's support


def test_verify_tokens_equals_verify_tree_with_one_hot_target():
    from tandem.ops.verify import verify_tokens

    gen = torch.Generator().manual_seed(123)
    vocab = 4
    for _ in range(300):
        n = int(torch.randint(0, 8, (1,), generator=gen))
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)], dtype=torch.long)
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        argmax = torch.randint(0, vocab, (n + 1,), generator=gen)
        target = torch.nn.functional.one_hot(argmax, vocab).float()
        draft = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
        uniform = torch.rand(n + 1, generator=gen)
        assert verify_tokens(parents, tokens, argmax.tolist().__getitem__) == verify_tree(parents, tokens, draft, target, uniform)


def test_verify_tokens_asks_for_the_rows_its_walk_reaches_only():
    """A tree: root children 0 (token 5) and 1 (token 6); node 0's child 2 (token 7); node 1's child 3 (token 8). The target's
    own tokens: 6 at the root, 8 after node 1: the walk takes node 1, then node 3, then asks row 4 (after node 3, a leaf)."""
    from tandem.ops.verify import verify_tokens

    own = {0: 6, 2: 8, 4: 9}
    asked = []
    result = verify_tokens(torch.tensor([-1, -1, 0, 1]), torch.tensor([5, 6, 7, 8]), lambda row: asked.append(row) or own[row])
    assert asked == [0, 2, 4]
    assert (result.accepted_nodes, result.tokens, result.bonus) == ([1, 3], [6, 8, 9], True)
    asked.clear()
    result = verify_tokens(torch.tensor([-1, 0, 1]), torch.tensor([3, 4, 5]), lambda row: asked.append(row) or 2)  # rejected at once
    assert asked == [0] and (result.accepted_nodes, result.tokens, result.bonus) == ([], [2], False)
