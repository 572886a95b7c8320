"""Adaptive draft length: picks long drafts when acceptance is high and drafting cheap, k = 0 otherwise."""
from types import SimpleNamespace

from tandem.engine.control import AdaptiveDraftLength
from tandem.ops.cost import best_draft_length, expected_tokens_per_step
from tandem.types import DraftTree, VerifyResult


def test_expected_tokens():
    assert expected_tokens_per_step([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens_per_step([0.5, 0.5], 2) == 1.75
    assert expected_tokens_per_step([0.9], 0) == 1.0


def test_best_k_follows_acceptance_and_costs():
    verify = [10.0, 11.0, 12.0, 13.0, 14.0]
    assert best_draft_length([0.9] * 4, 0.1, verify) == 4  # cheap drafts, high acceptance
    assert best_draft_length([0.1] * 4, 0.1, verify) == 0  # almost nothing accepted
    assert best_draft_length([0.9] * 4, 20.0, verify) == 0  # drafting costs more than it saves


def feed(policy, request, k, accepted, draft_s, verify_s, times):
    draft = DraftTree.chain(list(range(k)))
    result = VerifyResult(list(range(accepted)), list(range(accepted + 1)), k, accepted == k)
    for _ in range(times):
        policy.observe([request], [draft], [result], draft_s, verify_s)


def test_policy_turns_speculation_off_and_probes_rarely():
    policy = AdaptiveDraftLength(max_k=4)
    request = SimpleNamespace(request_id="r")
    feed(policy, request, 4, 0, draft_s=0.1, verify_s=0.05, times=20)  # expensive drafts, all rejected
    feed(policy, SimpleNamespace(request_id="plain"), 0, 0, draft_s=0.0, verify_s=0.04, times=5)
    ks = [policy.choose_k(request) for _ in range(200)]
    assert ks.count(0) >= 190  # probes cost <= 5 % of plain decoding time
    assert 0 < ks.count(2) <= 10


def test_policy_drafts_long_when_everything_is_accepted():
    policy = AdaptiveDraftLength(max_k=4)
    request = SimpleNamespace(request_id="r")
    feed(policy, request, 4, 4, draft_s=0.001, verify_s=0.05, times=20)
    feed(policy, SimpleNamespace(request_id="plain"), 0, 0, draft_s=0.0, verify_s=0.04, times=5)
    assert policy.choose_k(request) == 4
