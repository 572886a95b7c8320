"""One copy of each weight: oneDNN packing drops the dense copy, reads / state_dict / unpack / load recover it exactly.

These tests pin the oneDNN path (`gemm="onednn"`); the small-M kernel path, which keeps the dense weight as
its only copy, is tested in test_cpu_gemm.py."""
import pytest
import torch

from tandem.models.loader import load_transformer
from tandem.models.quantize import quantized_copy
from tandem.models.linear import Linear

ARCHS = ("llama", "qwen2", "qwen3")


def dense_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_pack_drops_dense_and_state_dict_is_exact(tiny_dirs, arch):
    model = load_transformer(tiny_dirs[arch])
    before = dense_state(model)
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
    model.pack(gemm="onednn")
    tied = model.cfg.tie_embeddings
    for name, lin in model.named_modules():
        if isinstance(lin, Linear):
            assert lin.packed is not None
            keeps = tied and name == "lm_head"
            assert ("weight" in lin._parameters) == keeps, name
            assert torch.equal(lin.weight, before[name + ".weight"])
            assert torch.equal(lin.dense_weight(), before[name + ".weight"])
    if tied:
        assert model.lm_head.weight is model.embed.weight
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.inference_mode():
        assert (model(ids).logits - want).abs().max().item() <= 1e-4


def test_unpack_restores_parameters_bit_for_bit(tiny_dirs):
    model = load_transformer(tiny_dirs["qwen2"])
    before = dense_state(model)
    model.pack(gemm="onednn")
    model.unpack()
    for name, lin in model.named_modules():
        if isinstance(lin, Linear):
            assert not lin.is_packed and isinstance(lin._parameters["weight"], torch.nn.Parameter)
            assert not lin.weight.requires_grad  # the loader froze the target; unpack keeps that
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert {n for n, _ in model.named_parameters()} >= {k for k in before if k != "lm_head.weight"}


def test_weight_change_through_unpack_write_pack_reaches_the_forward(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    reference = load_transformer(tiny_dirs["llama"])
    model.pack()
    model.unpack()
    with torch.no_grad():
        model.blocks[0].mlp.down.weight.mul_(2.0)
        reference.blocks[0].mlp.down.weight.mul_(2.0)
    model.pack()
    ids = torch.arange(9).view(1, 9)
    with torch.inference_mode():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() <= 1e-4


def test_load_state_dict_into_a_packed_model_repacks(tiny_dirs):
    model = load_transformer(tiny_dirs["qwen3"])
    other = load_transformer(tiny_dirs["qwen3"])
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    model.pack(gemm="onednn")
    model.load_state_dict(other.state_dict())
    assert model.blocks[1].attn.qkv.dense_dropped  # still one packed copy
    ids = torch.arange(5).view(1, 5)
    with torch.inference_mode():
        assert (model(ids).logits - other(ids).logits).abs().max().item() <= 1e-4


def test_keep_dense_keeps_both_and_training_path_uses_the_parameter(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    model.pack(keep_dense=True, gemm="onednn")
    lin = model.blocks[0].attn.o
    assert lin.packed is not None and "weight" in lin._parameters
    lin.weight.requires_grad_(True)
    x = torch.randn(2, lin.in_features)
    lin(x).sum().backward()  # grad mode: the dense path, gradient on the Parameter
    assert lin.weight.grad is not None and lin.weight.grad.shape == (lin.out_features, lin.in_features)


def test_int8_copy_from_a_packed_target_equals_one_from_a_dense_target(tiny_dirs):
    dense = load_transformer(tiny_dirs["qwen2"])
    packed = load_transformer(tiny_dirs["qwen2"])
    packed.pack()
    ids = torch.arange(6).view(1, 6)
    with torch.inference_mode():
        assert torch.equal(quantized_copy(packed)(ids).logits, quantized_copy(dense)(ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_bytes_count_one_copy_packed_or_not(tiny_dirs, arch):
    from tandem.bench.kernels.forward import weight_bytes_per_token, weight_bytes_total

    model = load_transformer(tiny_dirs[arch])
    dense = sum(p.numel() for p in model.parameters()) * 4
    per_token = weight_bytes_per_token(model)
    model.pack()
    assert weight_bytes_total(model) == dense
    assert weight_bytes_per_token(model) == per_token


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU")
def test_bf16_target_is_packed_where_onednn_supports_it(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"], torch.bfloat16)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
    model.pack()
    assert all(lin.packed is not None and lin.packed.dtype == torch.bfloat16 for lin in model.modules() if isinstance(lin, Linear))
    with torch.inference_mode():
        got = model(ids).logits
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()  # bf16: kernels round differently
    model.unpack()
    assert all(lin.packed is None and lin.weight.dtype == torch.bfloat16 for lin in model.modules() if isinstance(lin, Linear))


@pytest.mark.parametrize("gemm", ("int8", "int4", "bf16"))
def test_a_quantized_target_holds_its_bytes_once_and_serves_the_same_tokens(tiny_dirs, gemm):
    """pack(gemm=int8 / int4 / bf16) on a Transformer drops the fp32 weights (except a tied LM head, which the embedding
    holds); reads, state_dict and unpack give the quantized model's own (dequantized) weights, and the forward is the one
    of a model that kept its dense copy."""
    from tandem.models import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the CPU kernels did not build")
    kept = load_transformer(tiny_dirs["qwen2"])
    from tandem.models.linear import pack_linears

    pack_linears(kept, 8, keep_dense=True, gemm=gemm)
    model = load_transformer(tiny_dirs["qwen2"])
    model.pack(gemm=gemm)
    tied = model.cfg.tie_embeddings
    for name, lin in model.named_modules():
        if isinstance(lin, Linear):
            keeps = tied and name == "lm_head"
            assert ("weight" in lin._parameters) == keeps and lin.dense_dropped != keeps, name
            if not keeps:
                twin = kept.get_submodule(name)
                served = twin.compact.dense(twin.in_features) if twin.compact is not None else cpu_gemm.dequantize_q8(*twin.int8, twin.in_features)
                assert torch.equal(lin.weight, served) and torch.equal(lin.dense_weight(), served)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, kept(ids).logits)
    state = model.state_dict()
    model.load_state_dict(state)  # repacks and drops again
    assert model.blocks[0].mlp.down.dense_dropped
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, kept(ids).logits)
    model.unpack()
    assert all(not lin.is_packed and "weight" in lin._parameters for lin in model.modules() if isinstance(lin, Linear))
    assert torch.equal(model.blocks[0].mlp.down.weight, state["blocks.0.mlp.down.weight"])
