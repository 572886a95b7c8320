"""Per-step policy sync: Engine.update_target (validated, in place, repacked) and drafter re-sync."""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.errors import PolicyUpdateError
from tandem.models.loader import load_transformer
from tandem.models.quantize import Int8Linear, quantized_copy
from tandem.models.linear import Linear
from tandem.rl.rollout import RolloutEngine, update_policy
from tiny_helpers import load_packed, make_prompts, plain_outputs

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def perturbed(path, scale=0.05, seed=0) -> dict[str, torch.Tensor]:
    """Every parameter of the model at `path`, plus noise (what a learner would send)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=gen) for n, p in load_transformer(path).named_parameters()}


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in model.state_dict().items()}


def engines(path, names, k=3):
    target = load_packed(path)
    cfg = EngineConfig(max_batch_size=4, max_model_len=128)
    out = []
    for name in names:
        drafter = build_drafter(name, target=target, num_draft_tokens=k, max_batch=4, max_len=128) if name else None
        out.append(RolloutEngine(target, drafter, cfg))
    return target, out


@pytest.mark.parametrize("bad", ["unknown", "shape", "dtype", "nan", "busy", "not_a_dict"])
def test_refused_updates_change_nothing(tiny_llama, bad):
    target, (engine,) = engines(tiny_llama, [None])
    before = snapshot(target)
    new = perturbed(tiny_llama)
    name = "blocks.0.mlp.down.weight"
    if bad == "unknown":
        new["blocks.0.nope"] = torch.zeros(2)
    elif bad == "shape":
        new[name] = new[name][:, :-1]
    elif bad == "dtype":
        new[name] = new[name].double()
    elif bad == "nan":
        new[name][0, 0] = float("nan")
    elif bad == "busy":
        engine.engine.add_request([1, 2, 3], GREEDY)
    elif bad == "not_a_dict":
        new = list(new.items())
    with pytest.raises(PolicyUpdateError):
        engine.engine.update_target(new, 1)
    assert engine.policy_version == 0
    assert all(torch.equal(before[n], t) for n, t in target.state_dict().items())


def test_update_target_serves_the_new_weights(tiny_llama, tmp_path):
    target, (engine,) = engines(tiny_llama, [None])
    prompts = make_prompts(3, seed=4)
    old = [r.completion_ids for r in engine.generate_rollouts(prompts, 1, GREEDY).rollouts]
    new = perturbed(tiny_llama, scale=0.2)
    engine.engine.update_target(new, 7)
    fresh = load_transformer(tiny_llama)
    fresh.load_state_dict(new, strict=False)
    fresh.pack()
    batch = engine.generate_rollouts(prompts, 1, GREEDY)
    assert [r.completion_ids for r in batch.rollouts] == plain_outputs(fresh, prompts, [GREEDY] * 3)
    assert [r.completion_ids for r in batch.rollouts] != old  # the update really changed the policy
    assert {r.policy_version for r in batch.rollouts} == {7}


def int8_state(model) -> list[tuple]:
    """(name, int8 weights, scales, bias) of every quantized Linear: the kernel's rows, or fbgemm's where it did not build."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            qweight, _ = torch.ops.quantized.linear_unpack(m.packed)
            out.append((name, qweight.int_repr(), qweight.q_per_channel_scales(), m.bias))
        elif isinstance(m, Linear) and m.int8 is not None:
            out.append((name, m.int8[0], m.int8[1], m.bias))
    assert out, "no quantized Linear in the copy"
    return out


def test_self_draft_after_a_weight_change_equals_a_fresh_quantized_copy(tiny_llama):
    target, (plain, spec) = engines(tiny_llama, [None, "self_draft"])
    prompts = make_prompts(3, seed=6)
    spec.generate_rollouts(prompts, 1, GREEDY)  # the draft cache holds entries from the old weights
    drafter = spec.drafter
    version = drafter.version
    timings = update_policy([plain, spec], perturbed(tiny_llama, scale=0.2), 1)
    assert set(timings) == {"target", "resync/ar", "resync/self_draft"}
    assert drafter.version == version + 1 and spec.policy_version == plain.policy_version == 1
    assert drafter.shares_target_cache and drafter.cache is spec.engine.cache  # it drafts over the engine's cache, nothing of its own
    fresh = quantized_copy(target)
    for (n1, q1, s1, b1), (n2, q2, s2, b2) in zip(int8_state(drafter.model), int8_state(fresh), strict=True):
        assert n1 == n2 and torch.equal(q1, q2) and torch.equal(s1, s2) and (b1 is None) == (b2 is None)
    assert drafter.model.embed.weight.data_ptr() == target.embed.weight.data_ptr()  # still shared
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        assert torch.equal(drafter.model(ids).logits, fresh(ids).logits)
    # and speculation stays lossless on the new policy
    a = [r.completion_ids for r in spec.generate_rollouts(prompts, 1, GREEDY).rollouts]
    b = [r.completion_ids for r in plain.generate_rollouts(prompts, 1, GREEDY).rollouts]
    assert a == b


def test_self_draft_reshares_replaced_parameters(tiny_llama):
    target, (spec,) = engines(tiny_llama, ["self_draft"])
    target.embed.weight = torch.nn.Parameter(target.embed.weight.detach().clone() * 1.5)  # replaced, not written in place
    spec.drafter.resync()
    assert spec.drafter.model.embed.weight.data_ptr() == target.embed.weight.data_ptr()
