"""The target sampling transform and inverse-CDF sampling.

Random logits are continuous, so top-k / top-p boundaries never tie; seeds are fixed.
"""
from __future__ import annotations

import math

import pytest
import torch

from tandem.ops.sampling import draw_uniform, keyed_sample, keyed_sample_reference, race_key, sample_from_probs, sampling_probs

VOCAB = 20


def _params(rows: list[tuple[float, int, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p = zip(*rows)
    return torch.tensor(temperature), torch.tensor(top_k, dtype=torch.long), torch.tensor(top_p)


def _reference_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:  # [V]
    """HF generate's order and rules, one row at a time: temperature, then top-k, then top-p."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    scores = logits.double() / temperature
    if top_k > 0:
        kth_best = scores.sort(descending=True).values[min(top_k, scores.numel()) - 1]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if top_p < 1:
        # HF TopPLogitsWarper: ascending sort, drop tokens whose cumulative mass <= 1 - top_p,
        # always keep the most likely token.
        ascending, order = scores.sort()
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return scores.softmax(-1).float()


GRID = [
    (temperature, top_k, top_p)
    for temperature in (0.0, 0.3, 1.0, 1.7)
    for top_k in (0, 1, 3, 25)
    for top_p in (1.0, 0.9, 0.5, 0.05)
]


def test_matches_reference_with_per_row_params():
    """One batch, every row its own (temperature, top_k, top_p), against the row-by-row reference."""
    logits = torch.randn(len(GRID), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    probs = sampling_probs(logits, *_params(GRID))
    for row, (temperature, top_k, top_p) in enumerate(GRID):
        expected = _reference_row(logits[row], temperature, top_k, top_p)
        torch.testing.assert_close(probs[row], expected, msg=lambda m: f"row {GRID[row]}: {m}")
        alone = sampling_probs(logits[row : row + 1], *_params([GRID[row]]))
        torch.testing.assert_close(alone[0], probs[row])


def test_matches_hf_logits_warpers():
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    for temperature, top_k, top_p in [row for row in GRID if row[0] > 0]:
        scores = warpers.TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k > 0:
            scores = warpers.TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = warpers.TopPLogitsWarper(top_p)(None, scores)
        expected = scores.softmax(-1)
        torch.testing.assert_close(sampling_probs(logits, *_params([(temperature, top_k, top_p)])), expected)


def test_greedy_is_one_hot_on_argmax_whatever_the_filters():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    probs = sampling_probs(logits, *_params([(0.0, 0, 1.0), (0.0, 3, 0.5), (1.0, 0, 1.0)]))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    assert torch.equal(probs[:2], one_hot[:2])
    torch.testing.assert_close(probs[2], logits[2].softmax(-1))


def test_filters_always_keep_the_most_likely_token():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    torch.testing.assert_close(sampling_probs(logits, *_params([(1.0, 0, 1e-6), (1.0, 1, 1.0)])), one_hot)


def test_top_k_at_least_vocab_is_off_and_minus_inf_logits_get_zero():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, :5] = -math.inf
    plain = sampling_probs(logits, *_params([(0.7, 0, 1.0)]))
    torch.testing.assert_close(sampling_probs(logits, *_params([(0.7, VOCAB + 5, 1.0)])), plain)
    torch.testing.assert_close(plain[0], (logits[0] / 0.7).softmax(-1))
    assert (plain[0, :5] == 0).all() and torch.isfinite(plain).all()
    assert (sampling_probs(logits, *_params([(1.0, 3, 0.9)]))[0, :5] == 0).all()


# ---------------------------------------------------------------------------- sample_from_probs

LARGEST_BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))


def test_sample_never_returns_a_zero_probability_token():
    probs = torch.tensor([
        [0.0, 0.3, 0.0, 0.7, 0.0, 0.0],  # zeros first, between and last
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1e-30, 0.0, 0.0, 0.0, 0.0, 0.0],  # tiny, unnormalised
        [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
    ])
    edge = torch.tensor([0.0, 1e-12, 0.5, LARGEST_BELOW_ONE])
    random = torch.rand(2000, generator=torch.Generator().manual_seed(5))
    for uniform in torch.cat([edge, random]).tolist():
        tokens = sample_from_probs(probs, torch.full((len(probs),), uniform))
        assert (probs.gather(1, tokens[:, None]) > 0).all(), uniform


def test_sample_scales_with_unnormalised_rows():
    probs = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(6)), -1)
    uniform = torch.rand(4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(sample_from_probs(probs, uniform), sample_from_probs(probs * 3.5, uniform))


def test_sample_matches_probs_empirically():
    """Chi-square goodness of fit on 50k draws; false-failure probability 1e-4 (fails iff p < 1e-4)."""
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    num = 50_000
    uniform = torch.rand(num, generator=torch.Generator().manual_seed(8))
    counts = torch.bincount(sample_from_probs(probs.expand(num, -1), uniform), minlength=8).double()
    assert (counts[probs == 0] == 0).all()
    expected = probs.double()[probs > 0] * num
    stat = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int((probs > 0).sum()) - 1) / 2, dtype=torch.float64)
    assert float(torch.special.gammaincc(dof, stat / 2)) > 1e-4, counts


def test_draw_uniform_uses_each_generator():
    rows = draw_uniform([torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(1)], count=4)
    assert rows.shape == (3, 4) and ((rows >= 0) & (rows < 1)).all()
    assert torch.equal(rows[0], rows[2])
    assert draw_uniform([], count=3).shape == (0, 3)


def keyed_draws(probs: torch.Tensor, seed: int, count: int) -> torch.Tensor:  # [count] draws of one distribution, one position each
    return keyed_sample_reference(probs.expand(count, -1), [race_key(seed, position) for position in range(count)])


def test_race_key_is_splitmix64_of_seed_then_position():
    """Known values: SplitMix64's finaliser of seed + GAMMA is its first output for that seed (0 -> 0xE220A8397B1DCDAF)."""
    assert race_key(0, 0) == race_key(0, 0) and race_key(0, 0) != race_key(1, 0) != race_key(0, 1)
    from tandem.ops.sampling import GAMMA, _mix64
    assert _mix64(GAMMA) == 0xE220A8397B1DCDAF  # SplitMix64(seed 0)'s first number (Vigna's reference)
    key = _mix64((0xE220A8397B1DCDAF + 7 * GAMMA) % 2**64)
    assert race_key(0, 7) == (key - 2**64 if key >= 2**63 else key)


def test_keyed_sample_matches_probs_and_never_returns_a_zero_probability_token():
    """Chi-square goodness of fit of 20k draws (one position each), false failure 1e-4, and the negative control: the
    same draws fail against another distribution."""
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    num = 20_000
    counts = torch.bincount(keyed_draws(probs * 2.0, 3, num), minlength=8).double()  # unnormalised
    assert (counts[probs == 0] == 0).all()

    def p_value(reference):
        expected = reference.double()[reference > 0] * num
        stat = ((counts[reference > 0] - expected) ** 2 / expected).sum()
        dof = torch.tensor((int((reference > 0).sum()) - 1) / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(dof, stat / 2))
    assert p_value(probs) > 1e-4, counts
    assert p_value(torch.tensor([0.05, 0.0, 0.25, 0.2, 0.0, 0.25, 0.2, 0.05])) < 1e-4


def test_keyed_sample_couples_close_distributions():
    """Two distributions raced on the same numbers agree at least (1 - tv) / (1 + tv) of the time; the same one always
    does. Here tv = 0.1: bound 0.818 (independent draws would agree sum p q = 0.36)."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.4, 0.4, 0.2])
    same = (keyed_draws(p, 11, 4000) == keyed_draws(q, 11, 4000)).double().mean()
    assert float(same) > 0.818 - 0.03  # sd of the mean ~0.006
    assert torch.equal(keyed_draws(p, 11, 4000), keyed_draws(p, 11, 4000))


def test_keyed_sample_of_a_sub_vocabulary_races_on_its_token_ids():
    """A drafter's row over a part of the vocabulary (token_ids) draws the token the full row draws wherever it holds
    all of the mass: the numbers belong to token ids, not columns."""
    full = torch.zeros(5, 50)
    full[:, [3, 17, 41]] = torch.tensor([0.2, 0.5, 0.3])
    ids = torch.tensor([41, 3, 17, 8])
    keys = [race_key(9, position) for position in range(5)]
    assert torch.equal(ids[keyed_sample_reference(full[:, ids], keys, ids)], keyed_sample_reference(full, keys))


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 12.0])  # flat to peaked rows
def test_keyed_race_kernel_gives_the_reference_bits(scale):
    """The compiled race (which skips the logarithm where a token provably cannot win) draws what the torch ops draw."""
    from tandem.models import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the CPU kernels are not built here")
    gen = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(96, 4099, generator=gen) * scale, -1)
    probs[::3, ::7] = 0.0  # filtered tokens
    keys = [race_key(seed, seed * 31) for seed in range(96)]
    assert torch.equal(keyed_sample(probs, keys), keyed_sample_reference(probs, keys))
    ids = torch.randperm(50_000, generator=gen)[:4099]
    assert torch.equal(keyed_sample(probs, keys, ids), keyed_sample_reference(probs, keys, ids))
    for width in (1, 7, 9, 17):  # tails
        assert torch.equal(keyed_sample(probs[:8, :width], keys[:8]), keyed_sample_reference(probs[:8, :width], keys[:8]))
