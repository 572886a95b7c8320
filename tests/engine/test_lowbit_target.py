"""bf16, int8 and int4 targets (EngineConfig.weights), and int8 / int4 self-drafting: speculative output equals plain output of the same
served model, token for token, on every architecture."""
import pytest
import torch

from tandem.config import WEIGHTS, EngineConfig
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.models import cpu_gemm
from tandem.models.loader import load_transformer
from tandem.models.quant_gemm import pack_q4
from tandem.models.quantize import quantized_copy
from tandem.models.linear import Linear

from tiny_helpers import GREEDY, assert_full_budget_accounting, assert_replayed_drafts, make_prompts, ngram_chain, watch_decode_steps

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason=f"int4 / bf16 weights need the CPU kernels: {cpu_gemm.unusable_reason()}")


def _target(path, weights):
    model = load_transformer(path)
    model.pack(gemm=WEIGHTS[weights])
    return model


def _prompts():
    return [p + p[:5] + p for p in make_prompts(4, seed=5)]  # repeats: the ngram drafter gets accepted drafts


def _plain(path, weights):
    config = EngineConfig(max_batch_size=4, max_model_len=256, weights=weights)
    return [r.output_ids for r in Engine(_target(path, weights), config).run(_prompts(), [GREEDY] * 4)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("drafter", ["ngram", "self_draft"])  # self_draft: an int8 copy of the target
def test_speculation_equals_plain_decoding_of_the_same_weights(tiny_dirs, arch, weights, drafter):
    plain = _plain(tiny_dirs[arch], weights)
    target = _target(tiny_dirs[arch], weights)
    config = EngineConfig(max_batch_size=4, max_model_len=256, weights=weights)
    engine = Engine(target, config, drafter=build_drafter(drafter, target=target, num_draft_tokens=4, max_batch=4, max_len=256))
    steps = watch_decode_steps(engine)
    requests = engine.run(_prompts(), [GREEDY] * 4)
    assert [r.output_ids for r in requests] == plain
    if drafter == "ngram":  # verifies of several tokens ran (batch invariance was exercised) where the lookup found some
        assert_replayed_drafts(engine, steps, requests, ngram_chain)
    else:  # the int8 copy drafts whole chains of k = 4
        assert_full_budget_accounting(engine, steps, requests, 4)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_an_int4_self_draft_is_lossless_for_an_int8_or_fp32_target(tiny_dirs, weights):
    plain = _plain(tiny_dirs["qwen2"], weights)
    target = _target(tiny_dirs["qwen2"], weights)
    drafter = build_drafter("self_draft_int4", target=target, num_draft_tokens=4, max_batch=4, max_len=256)
    assert all(lin.compact is not None and lin.compact.kind == "int4" for lin in drafter.model.linears())
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=256, weights=weights), drafter=drafter)
    steps = watch_decode_steps(engine)
    requests = engine.run(_prompts(), [GREEDY] * 4)
    assert [r.output_ids for r in requests] == plain
    assert_full_budget_accounting(engine, steps, requests, 4)  # whole chains of k = 4


def test_the_int4_copy_quantizes_the_targets_dense_weights(tiny_llama):
    target = _target(tiny_llama, "int8")
    copy = quantized_copy(target, bits=4)
    down = copy.blocks[1].mlp.down
    assert torch.equal(down.compact.packed, pack_q4(target.blocks[1].mlp.down.weight)[0])
    assert copy.embed.weight.data_ptr() == target.embed.weight.data_ptr()  # shared, not copied
    with pytest.raises(ValueError, match="bits"):
        quantized_copy(target, bits=3)
    with pytest.raises(InvalidParameterError, match="draft_weights"):
        build_drafter("self_draft", target=target, draft_weights="int2", max_batch=1, max_len=64)


def test_a_weight_update_keeps_serving_int4(tiny_llama):
    target = _target(tiny_llama, "int4")
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=256, weights="int4"))
    new = {"blocks.0.mlp.down.weight": target.blocks[0].mlp.down.weight.detach() * 2}
    engine.update_target(new, 1)
    down = target.blocks[0].mlp.down
    assert torch.equal(down.compact.packed, pack_q4(new["blocks.0.mlp.down.weight"])[0])
    assert all(lin.compact is not None and lin.compact.kind == "int4" for lin in target.modules() if isinstance(lin, Linear))
