"""GRPO math against hand-computed values: advantages, each loss aggregation, clip-higher, decoupled PPO, k3 KL."""
import math

import pytest
import torch

from tandem.ops.rl import aggregation_divisor, group_advantages, k3_kl, policy_loss, token_weights
from tandem.rl.learner import lr_factor


def test_advantages_with_and_without_std_normalisation():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    assert torch.allclose(group_advantages(rewards, groups, eps=0.0), torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(group_advantages(rewards, groups, scale_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    r = torch.tensor([3.0, 0.0, 0.0, 0.0])  # Dr. GRPO keeps the reward's scale: mean 0.75
    assert torch.allclose(group_advantages(r, torch.zeros(4, dtype=torch.long), scale_by_std=False), torch.tensor([2.25, -0.75, -0.75, -0.75]))


# two samples: sample 0 has 2 tokens with advantage +1, sample 1 has 3 tokens with advantage -2; ratio 1 everywhere,
# so each token's loss is -A: sample 0's tokens -1 each, sample 1's +2 each.
SAMPLE_OF, LENGTHS, ADV = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 3]), torch.tensor([1.0, 1.0, -2.0, -2.0, -2.0])


@pytest.mark.parametrize("agg, max_tokens, want", [
    ("seq_mean_token_mean", 8, ((-1 - 1) / 2 + (2 + 2 + 2) / 3) / 2),  # GRPO: mean of sample means = 0.5
    ("token_mean", 8, (-2 + 6) / 5),  # DAPO: all tokens / token count = 0.8
    ("seq_mean_token_sum_norm", 8, (-2 + 6) / (2 * 8)),  # Dr. GRPO: all tokens / (samples * max_tokens) = 0.25
])
def test_each_aggregation_against_hand_values(agg, max_tokens, want):
    new = torch.zeros(5, requires_grad=True)
    loss, stats = policy_loss(new, torch.zeros(5), ADV, token_weights(SAMPLE_OF, LENGTHS, agg), 0.2, 0.2)
    total = loss / aggregation_divisor(LENGTHS.tolist(), agg, max_tokens)
    assert total.item() == pytest.approx(want, abs=1e-6)
    assert stats["clipped_tokens"] == 0 and stats["ratio_sum"] == pytest.approx(5.0)


def test_the_divisor_is_the_whole_batch_whatever_the_split():
    weights = token_weights(SAMPLE_OF, LENGTHS, "token_mean")
    whole, _ = policy_loss(torch.zeros(5), torch.zeros(5), ADV, weights, 0.2, 0.2)
    first, _ = policy_loss(torch.zeros(2), torch.zeros(2), ADV[:2], weights[:2], 0.2, 0.2)
    second, _ = policy_loss(torch.zeros(3), torch.zeros(3), ADV[2:], weights[2:], 0.2, 0.2)
    assert (first + second).item() == pytest.approx(whole.item())  # micro-batches sum to the whole numerator


def test_clip_higher_lets_positive_ratios_grow_further():
    new, old, adv, w = torch.log(torch.tensor([1.25, 0.7])), torch.zeros(2), torch.tensor([1.0, -1.0]), torch.ones(2)
    sym, s_sym = policy_loss(new, old, adv, w, 0.2, 0.2)
    asym, s_asym = policy_loss(new, old, adv, w, 0.2, 0.28)
    # token 0 (A > 0): min(1.25, clip) -> 1.2 symmetric, 1.25 with 1 + 0.28; token 1 (A < 0): -min(-0.7, -0.8) = 0.8 both
    assert sym.item() == pytest.approx(-1.2 + 0.8) and asym.item() == pytest.approx(-1.25 + 0.8)
    assert s_sym["clipped_tokens"] == 2 and s_asym["clipped_tokens"] == 1


def test_decoupled_objective_anchors_to_the_proximal_policy():
    new = torch.log(torch.tensor([0.5, 0.5])).requires_grad_(True)
    behaviour, proximal = torch.log(torch.tensor([0.25, 0.05])), torch.log(torch.tensor([0.5, 0.5]))
    adv, w = torch.tensor([1.0, 1.0]), torch.ones(2)
    loss, stats = policy_loss(new, behaviour, adv, w, 0.2, 0.2, proximal_logprobs=proximal, behaviour_cap=5.0)
    # ratio to the proximal policy is 1 (no clip); importance weights exp(prox - behaviour) = 2 and 10 -> capped at 5
    assert loss.item() == pytest.approx(-(2.0 + 5.0)) and stats["clipped_tokens"] == 0
    plain, plain_stats = policy_loss(new, behaviour, adv, w, 0.2, 0.2)  # anchored to behaviour: ratios 2 and 10, both clipped
    assert plain.item() == pytest.approx(-(1.2 + 1.2)) and plain_stats["clipped_tokens"] == 2
    same, _ = policy_loss(new, behaviour, adv, w, 0.2, 0.2, proximal_logprobs=behaviour)
    assert same.item() == pytest.approx(plain.item())  # proximal == behaviour: the standard objective


def test_k3_kl_and_its_place_in_the_loss():
    new, ref = torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.25, 0.2]))
    kl = k3_kl(new, ref)
    assert kl[0].item() == pytest.approx(0.5 + math.log(2) - 1) and kl[1].item() == pytest.approx(0.0)
    loss, stats = policy_loss(new, new.clone(), torch.zeros(2), torch.ones(2), 0.2, 0.2, ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1)) and stats["kl_sum"] == pytest.approx(0.5 + math.log(2) - 1)


def test_lr_schedule_values():
    assert [lr_factor(s, 2, 10, "constant", 0.1) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(6, 2, 10, "linear", 0.1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(2, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 2, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
