"""eagle_ngram / eagle_tree_ngram: the head's draft with a prompt-lookup branch grafted on, greedy-identical."""
import numpy as np
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.ops.ngram import ngram_candidates

from test_eagle_drafter import Req, catch_up
from tiny_helpers import GREEDY, load_packed, make_prompts, plain_outputs


def repetitive_prompts():
    """Prompts that repeat a phrase, so prompt lookup finds matches (the tiny target often repeats too)."""
    return [p + p[:6] + p for p in make_prompts(4, seed=2)]


@pytest.mark.parametrize("name", ["eagle_ngram", "eagle_tree_ngram"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_identical_and_the_branch_is_used(tiny_dirs, arch, name):
    ps = repetitive_prompts()
    target = load_packed(tiny_dirs[arch])
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=4, max_len=256)
    grafted = []
    graft = drafter._graft
    drafter._graft = lambda request, draft, budget: grafted.append(len(out := graft(request, draft, budget)) > len(draft)) or out
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=256), drafter=drafter)
    assert [r.output_ids for r in engine.run(ps, [GREEDY] * 4)] == plain_outputs(tiny_dirs[arch], ps, [GREEDY] * 4)
    assert any(grafted)  # some verified trees carried an n-gram branch


def test_the_ngram_continuation_is_a_path_of_the_draft(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=1, max_len=512)
    every_id = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    request = catch_up(drafter, target, every_id)  # whatever the first generated token is, it occurs earlier
    continuation = ngram_candidates(np.asarray(request.all_ids), 1, 4, 4, 1)[0]
    draft = drafter.propose([request], [drafter.max_nodes])[0]
    node, parents, tokens = -1, draft.parents.tolist(), draft.tokens.tolist()
    for token in continuation:  # walk the continuation down from the root
        node = next(i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token)
    assert len(draft) <= drafter.max_nodes and draft.draft_probs is None
    assert all(-1 <= p < i for i, p in enumerate(parents))


def test_budget_is_respected_and_zero_means_no_draft(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=1, max_len=128)
    prompt = repetitive_prompts()[0]
    assert len(drafter.propose([catch_up(drafter, target, prompt)], [3])[0]) <= 3
    assert len(drafter.propose([catch_up(drafter, target, prompt)], [0])[0]) == 0



@pytest.mark.parametrize("min_confidence", [0.0, 0.1])
def test_drafts_nest_so_one_verify_measures_every_smaller_budget(tiny_llama, min_confidence):
    """DraftShape.prefix = budget on every shape: budget b's draft is the first b nodes of the largest budget's (the
    head's chain, cut where unsure, then the lookup branch in order), with or without the confidence cut."""
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=1, max_len=512, draft_vocab_size=16,
                            min_confidence=min_confidence)
    assert [(s.budget, s.prefix) for s in drafter.shapes()] == [(b, b) for b in range(1, 9)]
    head_lengths = set()
    for prompt in repetitive_prompts():
        full = drafter.propose([catch_up(drafter, target, prompt)], [8])[0]
        head_lengths.add(len(drafter.eagle.propose([catch_up(drafter, target, prompt)], [4])[0]))
        for b in range(1, 9):
            alone = drafter.propose([catch_up(drafter, target, prompt)], [b])[0]
            assert alone.tokens.tolist() == full.tokens[:b].tolist() and alone.parents.tolist() == full.parents[:b].tolist()
    assert head_lengths == ({4} if min_confidence == 0 else {1, 2})  # cut at 0.1: the lookup fills the rest of every budget


def test_sampled_requests_get_the_heads_chain_alone(tiny_llama):
    target = load_packed(tiny_llama)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=1)
    hybrid = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=1, max_len=128)
    eagle = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=1, max_len=128)
    prompt = repetitive_prompts()[0]
    drafts = []
    for drafter in (hybrid, eagle):
        request = catch_up(drafter, target, prompt)
        request.params = sampled
        drafts.append(drafter.propose([request], [8])[0])
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist() and drafts[0].draft_probs is not None


def test_head_and_version_are_the_heads(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_ngram", target=target, num_draft_tokens=4, max_batch=1, max_len=64)
    assert drafter.head is drafter.eagle.head and drafter.taps == drafter.eagle.taps
    drafter.version = 7  # what a hot-swap does
    assert drafter.eagle.version == 7
