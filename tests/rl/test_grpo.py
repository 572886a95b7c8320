"""GRPO: the objective's math, gradient isolation of the online draft loss, 2-step runs (sync, async), resume."""
import pytest
import torch

from tandem.ops.rl import clipped_policy_loss, group_advantages
from tandem.rl.checkpoint import load_checkpoint, save_checkpoint
from tandem.rl.grpo import GRPOConfig
from tandem.rl.setup import build_trainer
from tandem.rl.tasks import TaskConfig


def test_group_advantages_exact():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))  # group 0: mean .5, std .5; group 1 constant


def test_clipped_policy_loss_clips_and_averages_per_sample():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.0, 1.1])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, 2.0])
    loss, stats = clipped_policy_loss(new, old, adv, torch.tensor([0, 0, 1, 1]), 2, clip_eps=0.2)
    # sample 0: -(min(1.5, 1.2) * 1 + min(-0.5, -0.8)) / 2 = -(1.2 - 0.8) / 2; sample 1: -(2 + 2.2) / 2
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2 - (2.0 + 2.2) / 2, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    assert new.grad[0] == 0 and new.grad[1] == 0  # clipped tokens carry no gradient
    assert new.grad[3].item() == pytest.approx(-1.1 * 2 / 2, abs=1e-6)


def parity_reward(text, problem):  # gives the tiny random model's groups reward variance
    return float(len(text) % 2)


def tiny_trainer(path, drafters, async_mode=False, **overrides):
    cfg = GRPOConfig(steps=2, prompts_per_step=2, group_size=3, max_tokens=8, lr=1e-3, micro_batch=4, eval_problems=4, eval_every=2,
                     async_mode=async_mode, seed=1, task=TaskConfig(kinds=("add",), max_value=9), **overrides)
    return build_trainer(path, drafters, cfg, num_draft_tokens=3, reward_fn=parity_reward)


def test_draft_loss_leaves_policy_gradients_bit_identical(tiny_llama):
    trainer = tiny_trainer(tiny_llama, ["eagle"])
    _, batches = trainer.rollouts(0)
    rollouts = batches["eagle"].rollouts
    adv = torch.linspace(-1, 1, len(rollouts))
    learner, online = trainer.learner, trainer.online
    grads = []
    for with_draft in (False, True):
        learner.model.zero_grad(set_to_none=True)
        online.head.zero_grad(set_to_none=True)
        loss, _, examples = learner.losses(rollouts, adv, len(rollouts), online)
        if with_draft:
            loss = loss + online.loss(examples, online.target_rows(learner.model))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in online.head.parameters())  # the head did get a loss


@pytest.mark.parametrize("async_mode", [False, True])
def test_two_step_grpo_run(tiny_llama, async_mode):
    trainer = tiny_trainer(tiny_llama, ["ar", "self_draft", "eagle"], async_mode=async_mode)
    before = {n: t.clone() for n, t in trainer.learner.named_tensors().items()}
    history = trainer.run()
    assert [h["step"] for h in history] == [0, 1]
    assert trainer.learner.version == 2 and all(e.policy_version == 2 for e in trainer.engines)
    served = trainer.engines[0].target.state_dict()
    after = trainer.learner.named_tensors()
    assert all(torch.equal(served[n], t) for n, t in after.items())  # the rollout engine serves the learner's weights
    assert any(not torch.equal(before[n], after[n]) for n in after)  # and they moved
    for h in history:
        assert set(h["rollout_s"]) == {"ar", "self_draft", "eagle"} and h["train_s"] > 0
        assert h["eagle_staleness"] == 1 and "resync/self_draft" in h["sync"]
    assert [h["sample_staleness"] for h in history] == ([0, 1] if async_mode else [0, 0])
    assert [h["overlapped"] for h in history] == [async_mode] * 2
    assert trainer.engines[1].drafter.version == 2  # self_draft re-quantized after each step
    assert [e["step"] for e in trainer.evals] == [0, 2]
    assert trainer.online.steps == 2


def test_checkpoint_resume_continues_identically(tiny_llama, tmp_path):
    a = tiny_trainer(tiny_llama, ["ar", "eagle"])
    a.run(steps=1)
    save_checkpoint(a, tmp_path / "ckpt")
    b = tiny_trainer(tiny_llama, ["ar", "eagle"])
    load_checkpoint(b, tmp_path / "ckpt")
    assert b.step_index == 1 and b.learner.version == 1 and b.engines[0].policy_version == 1
    assert b.online.trained_version == a.online.trained_version and len(b.history) == 1
    a.run(steps=1)
    b.run(steps=1)
    for (n, x), (_, y) in zip(a.learner.named_tensors().items(), b.learner.named_tensors().items()):
        assert torch.equal(x, y), n
    for x, y in zip(a.online.head.parameters(), b.online.head.parameters()):
        assert torch.equal(x, y)
    assert not list(tmp_path.glob("*.tmp")) and not list((tmp_path / "ckpt").glob("*.pt"))
