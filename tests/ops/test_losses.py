"""Distillation losses: the fused soft cross-entropy matches the reference in value and gradient."""
import pytest
import torch

from tandem.ops import losses
from tandem.ops.losses import forward_kl, in_vocab_mass, restricted_target_probs, soft_cross_entropy, soft_cross_entropy_reference, top1_agreement


def make(n=37, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(n, vocab, generator=gen) * 3
    target_probs = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, -1)
    weights = (torch.rand(n, generator=gen) > 0.3).float()
    return draft_logits, target_probs, weights


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [1024, 8])  # one chunk, and several (the chunked paths)
def test_fused_matches_reference_value_and_gradient(monkeypatch, weighted, chunk):
    monkeypatch.setattr(losses, "CHUNK_ROWS", chunk)
    draft_logits, target_probs, weights = make()
    w = weights if weighted else None
    a = draft_logits.clone().requires_grad_(True)
    b = draft_logits.clone().requires_grad_(True)
    ref = soft_cross_entropy_reference(a, target_probs, w)
    fused = soft_cross_entropy(b, target_probs, w)
    ref.backward()
    fused.backward()
    assert torch.allclose(ref, fused, atol=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_fused_gradient_passes_gradcheck():
    draft_logits, target_probs, weights = make(n=6, vocab=9)
    x = draft_logits.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, target_probs.double(), weights.double()), (x,))


def test_masked_rows_do_not_count():
    draft_logits, target_probs, _ = make(n=4)
    weights = torch.tensor([1.0, 0.0, 1.0, 0.0])
    junk = draft_logits.clone()
    junk[1] = 1e3
    assert torch.allclose(soft_cross_entropy(draft_logits, target_probs, weights), soft_cross_entropy(junk, target_probs, weights))


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    draft_logits, target_probs, _ = make()
    assert forward_kl(target_probs.log(), target_probs).abs() < 1e-5
    assert forward_kl(draft_logits, target_probs) > 0.1


def test_restricted_probs_renormalise_the_in_vocab_mass():
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(5, 20, generator=gen)
    draft_to_target = torch.tensor([3, 0, 17, 8])
    full = torch.softmax(target_logits, -1)
    want = full[:, draft_to_target] / full[:, draft_to_target].sum(-1, keepdim=True)
    assert torch.allclose(restricted_target_probs(target_logits, draft_to_target), want, atol=1e-6)
    assert torch.allclose(in_vocab_mass(target_logits, draft_to_target), full[:, draft_to_target].sum(-1), atol=1e-6)


def test_top1_agreement_counts_only_weighted_rows():
    draft_logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    target_probs = torch.tensor([[0.2, 0.8], [0.3, 0.7], [0.9, 0.1]])
    assert top1_agreement(draft_logits, target_probs) == (2, 3)
    assert top1_agreement(draft_logits, target_probs, torch.tensor([1.0, 1.0, 0.0])) == (1, 2)


def test_discard_loss_matches_its_definition_and_pushes_mass_off_the_token():
    from tandem.ops.losses import discard_loss, rejection_probability

    logits = torch.randn(5, 11, requires_grad=True)
    tokens = torch.tensor([0, 3, 3, 10, 7])
    r = rejection_probability(torch.tensor([0.0, 0.2, 0.5, 0.9, 0.1]), torch.tensor([1.0, 0.4, 0.5, 0.3, 1.0]))
    torch.testing.assert_close(r, torch.tensor([1.0, 0.5, 0.0, 0.0, 0.9]))
    loss = discard_loss(logits, tokens, r)
    q = torch.softmax(logits, -1)[torch.arange(5), tokens]
    torch.testing.assert_close(loss, -(r * torch.log1p(-q)).sum() / 5)
    loss.backward()
    grad_at_token = logits.grad[torch.arange(5), tokens]
    assert (grad_at_token[r > 0] > 0).all() and (grad_at_token[r == 0] == 0).all()  # descent lowers q(x) where rejected
    # stays finite when the draft is certain of the rejected token
    sure = torch.full((1, 4), -50.0)
    sure[0, 2] = 50.0
    assert torch.isfinite(discard_loss(sure, torch.tensor([2]), torch.tensor([1.0])))
    assert float(discard_loss(torch.randn(0, 4), torch.zeros(0, dtype=torch.long), torch.zeros(0))) == 0.0
