"""The mtp drafter (Medusa-style heads): greedy identity, trees, sampled rows, training helps."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models.mtp import save_mtp
from tandem.training.offline import TrainConfig, build_examples, train_head

from tiny_helpers import GREEDY, assert_full_budget_accounting, load_packed, make_prompts, plain_outputs, watch_decode_steps


def spec_engine(path, batch=4, **kw):
    target = load_packed(path)
    drafter = build_drafter("mtp", target=target, num_draft_tokens=4, max_batch=batch, max_len=256, **kw)
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=256), drafter=drafter)


def run(path, prompt_ids, params, batch=4, **kw):
    engine = spec_engine(path, batch, **kw)
    return [r.output_ids for r in engine.run(prompt_ids, params)], engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kw,nodes", [({}, 4), ({"tree_parents": [-1, -1, 0, 0, 1, 2]}, 6)])
def test_greedy_identical(tiny_dirs, arch, kw, nodes):
    """The heads draft whole chains of k = 4 / the whole static tree, cut by the budget."""
    ps = make_prompts()
    engine = spec_engine(tiny_dirs[arch], **kw)
    steps = watch_decode_steps(engine)
    requests = engine.run(ps, [GREEDY] * 4)
    assert [r.output_ids for r in requests] == plain_outputs(tiny_dirs[arch], ps, [GREEDY] * 4)
    assert_full_budget_accounting(engine, steps, requests, nodes)


def test_greedy_identical_when_rows_move_and_batches_mix(tiny_llama):
    ps = make_prompts(5, seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 30, 3, 17, 22)]
    params[1] = SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    got, _ = run(tiny_llama, ps, params, batch=2, draft_vocab_size=100)
    want = plain_outputs(tiny_llama, ps, params)
    assert [got[i] for i in (0, 2, 3, 4)] == [want[i] for i in (0, 2, 3, 4)]


def test_sampled_drafts_report_their_rows(tiny_llama):
    target = load_packed(tiny_llama)
    drafter = build_drafter("mtp", target=target, num_draft_tokens=3, draft_vocab_size=50)

    class Req:
        row, params, generator = 0, SamplingParams(temperature=0.7, top_k=5), torch.Generator().manual_seed(0)

    with torch.inference_mode():
        drafter.on_prefill(Req, target(torch.tensor([[5, 6, 7]])))
    draft = drafter.propose([Req], [3])[0]
    assert draft.draft_probs.shape == (3, target.cfg.vocab_size) and draft.is_chain
    assert torch.allclose(draft.draft_probs.sum(-1), torch.ones(3))
    assert ((draft.draft_probs > 0).sum(-1) <= 5).all()  # top-k applied to the draft logits
    assert (draft.draft_probs.gather(1, draft.tokens.view(-1, 1)) > 0).all()


def test_tree_deeper_than_the_heads_is_refused(tiny_llama):
    with pytest.raises(InvalidParameterError):
        build_drafter("mtp", target=load_packed(tiny_llama), num_draft_tokens=2, tree_parents=[-1, 0, 1])


def test_training_improves_acceptance(tiny_llama, tmp_path):
    """~50 steps on the target's own continuations of 4 prompts beat the untrained heads on them."""
    torch.manual_seed(0)
    target = load_packed(tiny_llama)
    ps = make_prompts(4, seed=5)
    examples = build_examples(target, ps, 24, ())
    cfg = TrainConfig(drafter="mtp", steps=50, batch_size=4, lr=3e-2, holdout=0.0, draft_vocab=target.cfg.vocab_size)
    heads, report = train_head(cfg, target, examples)
    save_mtp(heads, tmp_path / "mtp")
    _, untrained = run(tiny_llama, ps, [GREEDY] * 4)
    _, trained = run(tiny_llama, ps, [GREEDY] * 4, drafter_path=str(tmp_path / "mtp"))
    assert report["loss_last"] < report["loss_first"]
    assert trained.stats.acceptance_length > untrained.stats.acceptance_length + 0.2
