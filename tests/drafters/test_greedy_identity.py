"""Every drafter leaves greedy output token-identical to plain greedy decoding (tiny models)."""
import pytest
import torch

from tandem.config import EngineConfig
from tandem.drafters import build_drafter
from tandem.drafters.base import DrafterBase
from tandem.engine.control import AdaptiveDraftLength
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm
from tandem.models.tiny import make_tiny_model
from tandem.types import DraftTree
from tiny_helpers import (GREEDY, assert_full_budget_accounting, assert_greedy_verdicts, assert_replayed_drafts, load_packed, ngram_chain, ngram_trie,
                          plain_outputs, repetitive_prompts, watch_decode_steps)


def plain_greedy(path, prompts):
    return plain_outputs(path, prompts, [GREEDY] * len(prompts))


def spec_engine(path, name, batch=4, adaptive=False, **kw):
    target = load_packed(path)
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=batch, max_len=256, **kw)
    policy = AdaptiveDraftLength(max_k=4) if adaptive else None
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=256), drafter=drafter, draft_policy=policy)


LOOKUPS = {  # what prompt lookup (k = 4) drafts from a context within a budget, written with the ops it is made of
    "ngram": ngram_chain,
    "ngram_tree": ngram_trie,
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", ["ngram", "ngram_tree", "self_draft"])
def test_drafter_greedy_identical(tiny_dirs, arch, name):
    prompts = repetitive_prompts()
    engine = spec_engine(tiny_dirs[arch], name)
    steps = watch_decode_steps(engine)
    requests = engine.run(prompts, [GREEDY] * len(prompts))
    assert [r.output_ids for r in requests] == plain_greedy(tiny_dirs[arch], prompts)
    if name in LOOKUPS:
        assert_replayed_drafts(engine, steps, requests, LOOKUPS[name])
    else:  # the int8 copy drafts whole chains of k = 4
        assert_full_budget_accounting(engine, steps, requests, 4)


def test_self_draft_accepts_most_tokens(tiny_llama):
    """The int8 copy drafts whole chains; each verify keeps the prefix of its chain that the target's output continues
    with. How many that is depends on the model's bits (0.69 of the drafted tokens here, 0.61 through oneDNN)."""
    engine = spec_engine(tiny_llama, "self_draft")
    steps = watch_decode_steps(engine)
    requests = engine.run(repetitive_prompts(), [GREEDY] * 4)
    assert_full_budget_accounting(engine, steps, requests, 4)
    assert_greedy_verdicts(steps, requests)
    assert engine.stats.accepted_tokens / engine.stats.drafted_tokens > 0.5


def test_self_draft_drafts_over_the_engine_cache_and_leaves_its_lengths(tiny_llama):
    engine = spec_engine(tiny_llama, "self_draft")
    for prompt in repetitive_prompts()[:3]:
        engine.add_request(prompt, GREEDY)
    engine.step()  # prefill, then one speculative step
    drafter, lengths = engine.drafter, engine.cache.lengths.clone()
    assert drafter.cache is engine.cache
    assert all(int(lengths[r.row]) == len(r.all_ids) - 1 for r in engine.running)  # committed: all but the pending token
    drafts = drafter.propose(engine.running, [3] * len(engine.running))
    assert [len(d) for d in drafts] == [3, 3, 3] and torch.equal(engine.cache.lengths, lengths)
    with pytest.raises(RuntimeError, match="committed tokens"):  # a row out of step with its request is refused
        engine.cache.lengths[0] += 1
        drafter.propose(engine.running, [3] * len(engine.running))


def test_draft_model_greedy_identical(tiny_dirs, tmp_path):
    draft_dir = make_tiny_model(tmp_path / "draft", "qwen2", seed=7)
    prompts = repetitive_prompts(seed=1)
    engine = spec_engine(tiny_dirs["qwen2"], "draft_model", drafter_model=str(draft_dir))
    got = [r.output_ids for r in engine.run(prompts, [GREEDY] * len(prompts))]
    assert got == plain_greedy(tiny_dirs["qwen2"], prompts)


@pytest.mark.skipif(not cpu_gemm.available(), reason=f"int8 / int4 weights need the CPU kernels: {cpu_gemm.unusable_reason()}")
@pytest.mark.parametrize("name,kind", [("draft_model_int8", None), ("draft_model_int4", "int4")])
def test_a_quantized_draft_model_is_served_at_its_weights_and_stays_lossless(tiny_dirs, tmp_path, name, kind):
    draft_dir = make_tiny_model(tmp_path / "draft", "qwen2", seed=7)
    prompts = repetitive_prompts(seed=1)
    engine = spec_engine(tiny_dirs["qwen2"], name, drafter_model=str(draft_dir))
    linears = engine.drafter.model.linears()
    if kind is None:  # int8 rows
        assert all(lin.int8 is not None for lin in linears)
    else:
        assert all(lin.compact is not None and lin.compact.kind == kind for lin in linears)
    assert engine.drafter.name == name
    got = [r.output_ids for r in engine.run(prompts, [GREEDY] * len(prompts))]
    assert got == plain_greedy(tiny_dirs["qwen2"], prompts)


def test_draft_model_refuses_unknown_weights(tiny_dirs, tmp_path):
    with pytest.raises(InvalidParameterError, match="draft_weights must be one of"):
        spec_engine(tiny_dirs["qwen2"], "draft_model", drafter_model=tiny_dirs["qwen2"], draft_weights="int3")


def test_draft_model_drafting_for_itself_accepts_everything(tiny_dirs):
    engine = spec_engine(tiny_dirs["llama"], "draft_model", drafter_model=tiny_dirs["llama"])
    engine.run(repetitive_prompts(), [GREEDY] * 4)
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens


def test_adaptive_k_keeps_greedy_identity(tiny_llama):
    prompts = repetitive_prompts(seed=2)
    engine = spec_engine(tiny_llama, "ngram", adaptive=True)
    got = [r.output_ids for r in engine.run(prompts, [GREEDY] * len(prompts))]
    assert got == plain_greedy(tiny_llama, prompts)


class OracleTreeDrafter(DrafterBase):
    """Test drafter: a tree whose first branch is a wrong token and second branch follows the reference."""

    name = "oracle_tree"
    max_nodes = 7

    def __init__(self, reference: dict[tuple, list[int]], vocab: int):
        self.reference, self.vocab = reference, vocab

    def propose(self, requests, budgets):
        drafts = []
        for r, budget in zip(requests, budgets):
            ref = self.reference[tuple(r.prompt_ids)]
            done = len(r.output_ids)
            truth = ref[done : done + 3]
            if budget < 3 or len(truth) < 3:
                drafts.append(DraftTree.empty())
                continue
            wrong = [(t + 1) % self.vocab for t in truth]
            #        root -> wrong0 (0), truth0 (1); truth0 -> wrong1 (2), truth1 (3); truth1 -> truth2 (4), wrong2 (5); wrong0 -> truth1 (6)
            tokens = [wrong[0], truth[0], wrong[1], truth[1], truth[2], wrong[2], truth[1]]
            parents = [-1, -1, 1, 1, 3, 3, 0]
            drafts.append(DraftTree(torch.tensor(tokens), torch.tensor(parents)))
        return drafts


def test_tree_drafts_verified_in_one_pass_keep_greedy_identity(tiny_llama):
    prompts = repetitive_prompts(seed=3)
    reference = plain_greedy(tiny_llama, prompts)
    target = load_packed(tiny_llama)
    drafter = OracleTreeDrafter({tuple(p): ref for p, ref in zip(prompts, reference)}, target.cfg.vocab_size)
    engine = Engine(target, EngineConfig(max_batch_size=3, max_model_len=256), drafter=drafter)
    got = [r.output_ids for r in engine.run(prompts, [GREEDY] * len(prompts))]
    assert got == reference
    assert engine.stats.accepted_tokens >= engine.stats.drafts * 3 - 3  # the true path is always accepted
