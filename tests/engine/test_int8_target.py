"""An int8 target (EngineConfig.weights="int8"): a smaller model whose speculative output equals its own plain output."""
import pytest
import torch

from tandem.config import EngineConfig
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm
from tandem.models.loader import load_transformer
from tandem.models.linear import Linear
from tandem.ops.ngram import ngram_candidates
from tandem.ops.tree import graft_sequence

from tiny_helpers import GREEDY, assert_full_budget_accounting, assert_replayed_drafts, chain, make_prompts, ngram_chain, watch_decode_steps

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason=f"int8 weights need the small-M kernel: {cpu_gemm.unusable_reason()}")
CONFIG = EngineConfig(max_batch_size=4, max_model_len=256, weights="int8")


def int8_target(path):
    model = load_transformer(path)
    model.pack(gemm="int8")
    return model


def eagle_then_ngram(context, budget, drafted):
    """The untrained head's whole chain of min(4, budget) tokens (the step's first ones), prompt lookup's continuation
    grafted on within the budget."""
    head = chain(drafted[: min(4, budget)])
    found = ngram_candidates(context, 1, 4, 4, 1)
    return graft_sequence(*head, found[0], budget) if head[0] and found else head


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "eagle_ngram"])
def test_speculation_on_an_int8_target_equals_its_plain_decoding(tiny_dirs, drafter):
    ps = [p + p[:5] + p for p in make_prompts(4, seed=5)]
    plain = [r.output_ids for r in Engine(int8_target(tiny_dirs["qwen2"]), CONFIG).run(ps, [GREEDY] * 4)]
    target = int8_target(tiny_dirs["qwen2"])
    engine = Engine(target, CONFIG, drafter=build_drafter(drafter, target=target, num_draft_tokens=4, max_batch=4, max_len=256))
    steps = watch_decode_steps(engine)
    requests = engine.run(ps, [GREEDY] * 4)
    assert [r.output_ids for r in requests] == plain
    if drafter == "eagle":
        assert_full_budget_accounting(engine, steps, requests, 4)
    else:
        assert_replayed_drafts(engine, steps, requests, ngram_chain if drafter == "ngram" else eagle_then_ngram)


def test_a_weight_update_keeps_serving_int8(tiny_llama):
    target = int8_target(tiny_llama)
    engine = Engine(target, CONFIG)
    new = {"blocks.0.mlp.down.weight": target.blocks[0].mlp.down.weight.detach() * 2}
    engine.update_target(new, 1)
    down = target.blocks[0].mlp.down
    assert down.int8 is not None and torch.equal(down.int8[0], cpu_gemm.pack_q8(new["blocks.0.mlp.down.weight"])[0])
    assert all(lin.int8 is not None for lin in target.modules() if isinstance(lin, Linear))


def test_int8_weights_need_packing():
    with pytest.raises(InvalidParameterError, match="pack_weights"):
        EngineConfig(weights="int8", pack_weights=False)
    with pytest.raises(InvalidParameterError, match="weights"):
        EngineConfig(weights="int3")
    with pytest.raises(InvalidParameterError, match="pack_weights"):
        EngineConfig(weights="int4", pack_weights=False)
