"""head_state: a head's trainable tensors (what a weight version carries), the frozen shared LM head, in-place install."""
import pytest
import torch

from tandem.errors import InvalidParameterError
from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head
from tandem.models.head_state import derived_keys, install_trainable, make_trainable, trainable_state
from tandem.models.linear import pack_linears
from tandem.models.loader import load_transformer

LAYER = {"attn.o.weight", "attn.qkv.weight", "draft_to_target", "fc.weight", "hidden_norm.weight", "input_norm.weight",
         "mlp.down.weight", "mlp.gate_up.weight", "mlp_norm.weight", "norm.weight"}


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_transformer(tiny_llama)


def head_for(target, shared: bool):
    cfg = EagleConfig.for_target(target.cfg, 200, shared_lm_head=shared)
    return new_eagle_head(target, cfg, draft_vocab_from_tokens([list(range(50, 250))], 200, target.cfg.vocab_size), torch.Generator().manual_seed(0))


def moved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v + 0.25 if v.is_floating_point() else v.clone() for k, v in state.items()}


@pytest.mark.parametrize("shared", [True, False])
def test_the_trainable_state_and_parameters_leave_out_only_a_shared_lm_head(target, shared):
    head = make_trainable(head_for(target, shared).eval().requires_grad_(False))
    assert derived_keys(head.cfg) == (("lm_head.weight",) if shared else ())
    assert set(trainable_state(head)) == (LAYER if shared else LAYER | {"lm_head.weight"})
    assert head.training and head.lm_head.weight.requires_grad is not shared
    assert all(p.requires_grad for name, p in head.named_parameters() if name != "lm_head.weight")


def test_install_writes_in_place_and_a_dropped_dense_weight_is_restored_first(target):
    head = head_for(target, shared=True).eval()
    rows = target.lm_head.weight.detach().float()[head.draft_to_target]
    pack_linears(head, 4, keep_dense=False, gemm="onednn")  # every dense weight dropped: state_dict gives copies
    assert head.fc.dense_dropped and head.lm_head.dense_dropped
    new = moved(trainable_state(head))
    install_trainable(head, new)
    for name, tensor in trainable_state(head).items():
        assert torch.equal(tensor, new[name]), name
    assert head.fc.is_packed and torch.equal(head.fc.packed.to_dense(), new["fc.weight"])  # repacked from the new weight
    assert head.lm_head.dense_dropped and torch.equal(head.lm_head.weight, rows)  # the frozen LM head: not touched


@pytest.mark.parametrize("bad", ["lm_head", "missing", "shape"])
def test_install_refuses_other_names_or_shapes_and_changes_nothing(target, bad):
    head = head_for(target, shared=True).eval()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    new = moved(trainable_state(head))
    if bad == "lm_head":
        new["lm_head.weight"] = before["lm_head.weight"]
    elif bad == "missing":
        del new["norm.weight"]
    else:
        new["norm.weight"] = new["norm.weight"][:1]  # copy_ would broadcast it
    with pytest.raises(InvalidParameterError, match="lm_head.weight|norm.weight"):
        install_trainable(head, new)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name]), name
