"""The eagle / eagle_tree drafters: greedy identity, tree shapes, sampled losslessness, learning helps."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.drafters.eagle import TRAINED_MIN_CONFIDENCE, EagleDrafter, TreeOptions, sibling_ranks
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleConfig, save_eagle
from tandem.training.offline import TrainConfig, build_examples, train_head

from tiny_helpers import (FALSE_FAILURE, GREEDY, SAMPLES, SMALL_VOCAB as VOCAB, assert_full_budget_accounting, chi_square_p_value, load_packed,
                          make_prompts, plain_outputs, watch_decode_steps)

STATIC = [-1, -1, 0, 0, 1, 2, 2, 4]


def spec_engine(path, name, batch=4, **kw):
    target = load_packed(path)
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=batch, max_len=256, **kw)
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=256), drafter=drafter)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("name,kw,nodes", [("eagle", {}, 4), ("eagle_tree", {}, 12), ("eagle", {"tree_parents": STATIC}, len(STATIC))])
def test_greedy_identical(tiny_dirs, arch, name, kw, nodes):
    """An untrained head drafts whole chains of k = 4 / trees of max_nodes (12) / the static tree, cut by the budget."""
    ps = make_prompts()
    engine = spec_engine(tiny_dirs[arch], name, **kw)
    steps = watch_decode_steps(engine)
    requests = engine.run(ps, [GREEDY] * 4)
    assert [r.output_ids for r in requests] == plain_outputs(tiny_dirs[arch], ps, [GREEDY] * 4)
    assert_full_budget_accounting(engine, steps, requests, nodes)


@pytest.mark.parametrize("name", ["eagle", "eagle_tree"])
def test_greedy_identical_when_rows_move(tiny_llama, name):
    """Requests of different lengths through 2 rows: rows are refilled and moved (draft state must follow)."""
    ps = make_prompts(5, seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 30, 3, 17, 22)]
    engine = spec_engine(tiny_llama, name, batch=2, draft_vocab_size=200)
    assert [r.output_ids for r in engine.run(ps, params)] == plain_outputs(tiny_llama, ps, params)


def test_mixed_batch_keeps_greedy_rows_identical(tiny_llama):
    """A sampled request in the batch turns trees into chains; greedy rows still match plain decoding."""
    ps = make_prompts()
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True), GREEDY, GREEDY]
    got = [r.output_ids for r in spec_engine(tiny_llama, "eagle_tree").run(ps, params)]
    want = plain_outputs(tiny_llama, ps, params)
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]


class Req:
    """A DraftContext stand-in."""

    def __init__(self, all_ids, row=0, params=GREEDY):
        self.row, self.request_id, self.params, self.generator = row, f"r{row}", params, torch.Generator().manual_seed(0)
        self.all_ids = all_ids


def catch_up(drafter, target, prompt, row=0):
    """Prefill the target and the drafter for one request, as the engine does."""
    with torch.inference_mode():
        out = target(torch.tensor([prompt]), taps=drafter.taps)
    request = Req(prompt + [int(out.logits[0, -1].argmax())], row)
    drafter.on_prefill(request, out)
    return request


def test_batched_catch_up_drafts_what_each_request_drafts_alone(tiny_llama):
    """Rows with queues of different lengths (one longer than PAD_LIMIT) share one padded forward."""
    target = load_packed(tiny_llama)
    gen = torch.Generator().manual_seed(4)
    short, long = torch.randint(0, 256, (5,), generator=gen).tolist(), torch.randint(0, 256, (23,), generator=gen).tolist()
    make = lambda batch: build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=batch, max_len=64)  # noqa: E731
    both = make(2)
    together = both.propose([catch_up(both, target, short, 0), catch_up(both, target, long, 1)], [4, 4])
    alone = [(d := make(1)).propose([catch_up(d, target, p)], [4])[0] for p in (short, long)]
    assert [t.tokens.tolist() for t in together] == [t.tokens.tolist() for t in alone]


def test_static_tree_first_children_path_is_the_greedy_chain(tiny_llama):
    """Siblings share the draft cache but must be invisible to each other: the rank-0 path equals the chain."""
    target = load_packed(tiny_llama)
    tree = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=1, max_len=64, tree_parents=[-1, -1, 0, 0, 2, 2, 4, 4])
    chain = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=1, max_len=64)
    prompt = make_prompts(1)[0]
    tree_draft = tree.propose([catch_up(tree, target, prompt)], [8])[0]
    chain_draft = chain.propose([catch_up(chain, target, prompt)], [4])[0]
    assert tree_draft.tokens[[0, 2, 4, 6]].tolist() == chain_draft.tokens.tolist()


def test_dynamic_tree_shape(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_tree", target=target, num_draft_tokens=4, max_batch=1, max_len=64, max_nodes=10, tree_topk=3)
    request = catch_up(drafter, target, make_prompts(1)[0])
    draft = drafter.propose([request], [50])[0]
    assert len(draft) == 10 and draft.draft_probs is None
    assert all(-1 <= p < i for i, p in enumerate(draft.parents.tolist()))  # topological
    assert len(set(zip(draft.parents.tolist(), draft.tokens.tolist()))) == 10  # no duplicate children
    assert sum(1 for p in draft.parents.tolist() if p == -1) <= 3
    assert drafter.max_nodes == 10


def test_budgets_cap_the_tree(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle_tree", target=target, num_draft_tokens=4, max_batch=1, max_len=64)
    assert len(drafter.propose([catch_up(drafter, target, make_prompts(1)[0])], [2])[0]) == 2


def test_options_validate():
    assert sibling_ranks((-1, -1, 0, 0, 1, -1)) == [0, 1, 0, 1, 0, 2]
    with pytest.raises(InvalidParameterError):
        TreeOptions("bushy")
    with pytest.raises(InvalidParameterError):
        TreeOptions("static", parents=(0,))


def test_sampled_drafts_report_rows_inside_the_draft_vocabulary(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle", target=target, num_draft_tokens=3, max_batch=1, max_len=64, draft_vocab_size=100)
    request = catch_up(drafter, target, make_prompts(1)[0])
    request.params = SamplingParams(temperature=0.8, top_p=0.95)
    draft = drafter.propose([request], [3])[0]
    assert draft.draft_probs.shape == (3, target.cfg.vocab_size)
    assert torch.allclose(draft.draft_probs.sum(-1), torch.ones(3))
    outside = torch.ones(target.cfg.vocab_size, dtype=torch.bool)
    outside[drafter.draft_to_target] = False
    assert draft.draft_probs[:, outside].sum() == 0
    assert (draft.draft_probs.gather(1, draft.tokens.view(-1, 1)) > 0).all()


def test_wrong_number_of_hidden_states_is_refused(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle", target=target, max_batch=1, max_len=64)
    out = target(torch.tensor([[1, 2, 3]]), taps=(0,))
    with pytest.raises(InvalidParameterError, match="taps"):
        drafter.on_prefill(catch_up(drafter, target, [1, 2]), out)


PROMPT = [3, 5, 7, 3, 5]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


def exact_distribution(target, length=3) -> dict[tuple, float]:
    from tandem.ops.sampling import sampling_probs

    dist = {(): 1.0}
    for _ in range(length):
        contexts = [c for c in dist if dist[c] > 0]
        with torch.inference_mode():
            logits = target(torch.tensor([PROMPT + list(c) for c in contexts])).logits[:, -1]
        n = len(contexts)
        probs = sampling_probs(logits, torch.full((n,), SAMPLED.temperature), torch.zeros(n, dtype=torch.long), torch.full((n,), SAMPLED.top_p))
        dist = {c + (t,): dist[c] * probs[i, t].item() for i, c in enumerate(contexts) for t in range(VOCAB)}
    return dist


@pytest.mark.parametrize("name", ["eagle", pytest.param("eagle_tree", marks=pytest.mark.slow), pytest.param("mtp", marks=pytest.mark.slow)])
def test_sampled_output_has_target_distribution_with_a_reduced_vocabulary(small_vocab_model, name):
    """Chi-square test of the first three sampled tokens (false-failure probability FALSE_FAILURE, fixed seeds).

    The draft vocabulary holds 8 of the 12 tokens, so drafts have zero probability on 4 target tokens.
    """
    engine = spec_engine(small_vocab_model, name, batch=64, draft_vocab_size=8)
    params = [SamplingParams(max_tokens=3, temperature=SAMPLED.temperature, top_p=SAMPLED.top_p, seed=s, ignore_eos=True) for s in range(SAMPLES)]
    runs = engine.run([PROMPT] * SAMPLES, params)
    stats = engine.stats
    assert stats.drafted_tokens == stats.drafts == SAMPLES  # max_tokens 3: each request's first verify has a budget of 1, filled
    assert stats.request_steps == 2 * SAMPLES - stats.accepted_tokens  # accepted: done in that verify; rejected: one more
    assert 0 < stats.accepted_tokens < SAMPLES  # the verifies both accepted and rejected drafts (the sampled path ran)
    counts: dict[tuple, int] = {}
    for r in runs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert chi_square_p_value(counts, exact_distribution(load_packed(small_vocab_model)), SAMPLES) > FALSE_FAILURE


def acceptance(target, drafter, ps):
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=256), drafter=drafter)
    engine.run(ps, [GREEDY] * len(ps))
    return engine.stats.acceptance_length


def test_training_improves_acceptance(tiny_llama, tmp_path):
    """~50 steps on the target's own continuations of 4 prompts beat the untrained head on them."""
    torch.manual_seed(0)
    target = load_packed(tiny_llama)
    ps = make_prompts(4, seed=5)
    examples = build_examples(target, ps, 24, EagleConfig.for_target(target.cfg).taps)
    cfg = TrainConfig(drafter="eagle", steps=50, batch_size=4, lr=3e-2, holdout=0.0, draft_vocab=target.cfg.vocab_size, unroll=3)
    head, report = train_head(cfg, target, examples)
    save_eagle(head, tmp_path / "head")
    untrained = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=4, max_len=256)
    trained = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=4, max_len=256, drafter_path=str(tmp_path / "head"), min_confidence=0.0)
    assert report["loss_last"] < report["loss_first"]
    assert acceptance(target, trained, ps) > acceptance(target, untrained, ps) + 0.2
    assert isinstance(trained, EagleDrafter)
    assert build_drafter("eagle", target=target, max_batch=4, max_len=256, drafter_path=str(tmp_path / "head")).min_confidence == TRAINED_MIN_CONFIDENCE
    assert untrained.min_confidence == 0.0  # an untrained head drafts full chains


@pytest.mark.parametrize("name", ["eagle", "eagle_tree"])
def test_confidence_cut_drafts_less_and_changes_no_output(tiny_llama, name):
    """Chains end (tree nodes are dropped) where the head's path confidence falls below min_confidence: fewer drafted
    tokens, the same greedy outputs; above every path's confidence (an untrained head's top probability is ~1/Vd)
    nothing is drafted."""
    ps = make_prompts()
    want = plain_outputs(tiny_llama, ps, [GREEDY] * 4)
    drafted = {}
    for cut in (0.0, 0.003, 0.9):
        engine = spec_engine(tiny_llama, name, draft_vocab_size=200, min_confidence=cut)
        assert [r.output_ids for r in engine.run(ps, [GREEDY] * 4)] == want
        drafted[cut] = engine.stats.drafted_tokens
        if cut == 0.0:
            assert drafted[cut] > 3 * engine.stats.request_steps  # full chains of k = 4 / trees of 12 (less only near max_tokens)
    assert 0 < drafted[0.003] < drafted[0.0]  # top probabilities of ~1/200 .. 0.06: some first tokens pass, few chains go on
    assert drafted[0.9] == 0
    with pytest.raises(InvalidParameterError, match="min_confidence"):
        spec_engine(tiny_llama, "eagle", min_confidence=1.0)


class PlainThenDraft:
    """A draft policy: every row plain for `plain_steps` decode steps, then budget 4."""

    def __init__(self, plain_steps: int):
        self.plain_steps, self.steps = plain_steps, 0

    def plan(self, requests) -> list[int]:
        self.steps += 1
        return [0 if self.steps <= self.plain_steps else 4] * len(requests)

    def observe(self, *args, **kwargs) -> None:
        pass

    def release(self, request) -> None:
        pass


def test_plain_steps_queue_tap_features_and_the_catch_up_fuses_them_once(tiny_llama):
    """While rows draft nothing the head's fc never runs (their tap features queue as chunks, no per-step fuse or copy of
    the queue); each drafting step fuses every row's queue in one call, and the outputs stay plain decoding's."""
    target = load_packed(tiny_llama)
    drafter = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=2, max_len=256)
    policy = PlainThenDraft(6)
    engine = Engine(target, EngineConfig(max_batch_size=2, max_model_len=256), drafter=drafter, draft_policy=policy)
    fuses = []  # the policy's step count at each fc call
    drafter.head.fc.register_forward_hook(lambda module, args, out: fuses.append(policy.steps))
    ps = make_prompts(2)
    assert [r.output_ids for r in engine.run(ps, [GREEDY] * 2)] == plain_outputs(tiny_llama, ps, [GREEDY] * 2)
    assert fuses[0] == 7  # none at the prefill nor in the 6 plain steps: the first at the first drafting step
    assert len(fuses) == len(set(fuses)) >= 3  # one per drafting step (its catch-up), both rows in one call


class FirstRowWaits(PlainThenDraft):
    """Row 0 plain for `plain_steps` decode steps while row 1 drafts 4 from the first; then both draft 4."""

    def plan(self, requests) -> list[int]:
        self.steps += 1
        return [0 if request.row == 0 and self.steps <= self.plain_steps else 4 for request in requests]


@pytest.mark.parametrize("name", ["eagle", "eagle_tree"])
def test_a_row_that_does_not_draft_is_not_caught_up_while_the_others_draft(tiny_llama, name):
    """A step where some rows draft catches only those up (at 16 rows, catching every row up for a probe on a few cost
    100-230 ms): row 0's tap features wait in its queue through 6 steps in which row 1 drafts, its first drafting step
    writes the whole queue (prompt + 6 steps), and the outputs stay plain decoding's."""
    target = load_packed(tiny_llama)
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=2, max_len=256)
    policy = FirstRowWaits(6)
    engine = Engine(target, EngineConfig(max_batch_size=2, max_model_len=256), drafter=drafter, draft_policy=policy)
    fused = []  # (policy step, feature rows into the fc) per fc call
    drafter.head.fc.register_forward_hook(lambda module, args, out: fused.append((policy.steps, args[0].shape[-2])))
    ps = make_prompts(2)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    assert [r.output_ids for r in engine.run(ps, params)] == plain_outputs(tiny_llama, ps, params)
    per_step = dict(fused)
    assert per_step[1] == len(ps[1])  # step 1: row 1's prompt alone (row 0 keeps its queue and takes a placeholder)
    assert len(ps[0]) + 7 <= per_step[7] <= len(ps[0]) + 6 + 5  # step 7: row 0's prompt and one token for each of the 6 steps, then row 1's 1-5
