"""GRPO on the tiny model: seeds, learner vs engine log-probs, one step's direction, skipping, 2-step runs (sync, async), resume."""
import pytest
import torch

from tandem.errors import TandemError
from tandem.rl.checkpoint import load_checkpoint, save_checkpoint
from tandem.rl.envs import EnvConfig
from tandem.rl.grpo import GRPOConfig, sample_seed
from tandem.rl.setup import build_trainer


def parity_reward(text, problem, env):  # gives the tiny random model's groups reward variance
    return float(len(text) % 2)


TINY_ENV = EnvConfig.for_tasks(["basic_arithmetic", "chain_sum"])  # short questions: the tiny model's byte tokens fit its 512
TINY_ENV = EnvConfig(TINY_ENV.tasks, TINY_ENV.task_kwargs, demonstration=False)


def tiny_trainer(path, drafters, async_mode=False, **overrides):
    settings = dict(steps=2, prompts_per_step=2, group_size=3, max_tokens=8, lr=1e-3, micro_batch=4, eval_problems=4, eval_every=2,
                    async_mode=async_mode, seed=1, env=TINY_ENV) | overrides
    cfg = GRPOConfig(**settings)
    return build_trainer(path, drafters, cfg, num_draft_tokens=3, reward_fn=parity_reward)


def fake_clock(learner, monkeypatch, tick: float = 0.25) -> None:
    """The learner module's clock stands still except at the optimiser's steps, each of which takes `tick` seconds."""
    import types

    import tandem.rl.learner as learner_module

    now = [1000.0]
    monkeypatch.setattr(learner_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    learner.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: now.__setitem__(0, now[0] + tick))


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
        stats = {k: 0 for k in ("tokens", "ratio_sum", "ratio_max", "clipped_tokens", "kl_sum", "importance_sum", "entropy_sum")}
        loss, examples = learner._micro_loss(rollouts, adv, [{} for _ in rollouts], stats, online)
        if with_draft:
            loss = loss + online.loss(examples, online.target_rows(learner.model))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in online.head.parameters())  # the head did get a loss


@pytest.mark.parametrize("async_mode", [False, True])
def test_two_step_grpo_run(tiny_llama, async_mode, monkeypatch):
    trainer = tiny_trainer(tiny_llama, ["ar", "self_draft", "eagle"], async_mode=async_mode)
    before = {n: t.clone() for n, t in trainer.learner.named_tensors().items()}
    fake_clock(trainer.learner, monkeypatch)
    history = trainer.run()
    assert [h["step"] for h in history] == [0, 1]
    assert trainer.learner.version == 2 and all(e.policy_version == 2 for e in trainer.engines)
    served = trainer.engines[0].target.state_dict()
    after = trainer.learner.named_tensors()
    assert all(torch.equal(served[n], t) for n, t in after.items())  # the rollout engine serves the learner's weights
    trainable = {n for n, p in trainer.learner.model.named_parameters() if p.requires_grad}
    assert "embed.weight" not in trainable and len(trainable) > 0  # the (tied) embedding stays frozen by default
    assert {n for n in after if not torch.equal(before[n], after[n])} == trainable  # every trainable tensor moved, nothing else
    for h in history:  # the learner's clock advanced by 0.25 s at each optimiser step only: one per update
        assert set(h["rollout_s"]) == {"ar", "self_draft", "eagle"} and h["train_s"] == 0.25
        assert h["same_rollouts"] == {"ar": True, "self_draft": True, "eagle": True}  # sampled (T = 1), token for token
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


def test_sample_seeds_are_distinct_across_steps_prompts_and_samples():
    seeds = {sample_seed(0, 1, step, prompt, sample) for step in range(20) for prompt in range(8) for sample in range(8)}
    assert len(seeds) == 20 * 8 * 8  # the old scheme's step s / sample i + 1 == step s + 1 / sample i collision is gone
    assert sample_seed(0, 1, 3, 0, 1) != sample_seed(0, 1, 4, 0, 0) and sample_seed(0, 1, 2, 0, 0) == sample_seed(0, 1, 2, 0, 0)
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_step_zero_learner_logprobs_equal_the_engines(tiny_llama):
    trainer = tiny_trainer(tiny_llama, ["ar"], temperature=0.7)
    batch_problems, batches = trainer.rollouts(0)
    rollouts = batches["ar"].rollouts
    engine = torch.tensor([lp for r in rollouts for lp in r.logprobs])
    learner = trainer.learner.logprobs(rollouts)
    assert torch.allclose(learner, engine, atol=1e-4, rtol=0)
    stats = trainer.learner.update(rollouts, torch.linspace(-1, 1, len(rollouts)), 0)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and stats["clip_fraction"] == 0.0  # sync, one mini-batch: on-policy


def test_one_step_raises_positive_and_lowers_negative_samples(tiny_llama):
    trainer = tiny_trainer(tiny_llama, ["ar"], lr=3e-3)
    _, batches = trainer.rollouts(0)
    rollouts = batches["ar"].rollouts
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))])
    counts = [len(r.completion_ids) for r in rollouts]

    def per_sample(lp):
        return torch.stack([part.sum() for part in torch.split(lp, counts)])

    before = per_sample(trainer.learner.logprobs(rollouts))
    trainer.learner.update(rollouts, adv, 0)
    delta = per_sample(trainer.learner.logprobs(rollouts)) - before
    assert (delta[adv > 0] > 0).all() and (delta[adv < 0] < 0).all()


def test_zero_advantage_samples_are_skipped_without_changing_the_divisor(tiny_llama):
    grads = {}
    for skip in (True, False):
        trainer = tiny_trainer(tiny_llama, ["ar"], skip_zero_advantage=skip)
        _, batches = trainer.rollouts(0)
        rollouts = batches["ar"].rollouts
        adv = torch.tensor([1.0, -1.0] + [0.0] * (len(rollouts) - 2))
        learner = trainer.learner
        learner.optimizer.step = lambda: None  # keep the gradients to compare them, not the update
        stats = learner.update(rollouts, adv, 0)
        assert stats["skipped_samples"] == (len(rollouts) - 2 if skip else 0)
        grads[skip] = [p.grad.clone() for p in learner.params if p.grad is not None]
    assert len(grads[True]) == len(grads[False]) > 0
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("overrides", [dict(ppo_epochs=2, mini_batches=2), dict(kl_coef=0.05, loss_agg="token_mean"),
                                       dict(clip_high=0.28, scale_adv_by_std=False, loss_agg="seq_mean_token_sum_norm")])
def test_grpo_options_run_and_report(tiny_llama, overrides):
    """Each option reaches the update: the lr at the last optimiser step follows warm-up then cosine over
    ppo_epochs x mini_batches steps, advantages are scaled by the group's std or not, and a one-pass update reports
    the entropy of the policy it started from over the tokens it trained on (computed here by hand)."""
    trainer = tiny_trainer(tiny_llama, ["ar"], steps=1, warmup_steps=2, lr_schedule="cosine", **overrides)
    learner, update, score_of, seen = trainer.learner, trainer.learner.update, trainer.score, {}

    def score(batch, problems):  # the call just before an update scores that update's batch
        scored = score_of(batch, problems)
        seen["latest"] = scored["rewards"]
        return scored

    trainer.score = score

    def update_by_hand_first(rollouts, advantages, step, online=None):
        skipped = trainer.cfg.kl_coef == 0  # the KL term needs every sample
        trained = [r for r, a in zip(rollouts, advantages) if not (skipped and float(a) == 0.0)]
        with torch.no_grad():
            logp = torch.log_softmax(learner._logprobs(learner.model, trained)[1], -1)
        seen.update(rewards=seen["latest"], advantages=advantages.clone(), groups=torch.tensor([r.prompt_index for r in rollouts]),
                    entropy=float(-(logp.exp() * logp).sum(-1).mean()))
        return update(rollouts, advantages, step, online)

    learner.update = update_by_hand_first
    record = trainer.run()[0]
    steps = overrides.get("ppo_epochs", 1) * overrides.get("mini_batches", 1)
    assert record["optimizer_steps"] == steps and trainer.learner.version == 1
    # lr 1e-3; warm-up over optimiser steps 0, 1 (x 1/2, x 1); step 3 of 4 is half way down the cosine to 0.1
    assert record["lr"] == pytest.approx({1: 1e-3 * 0.5, 4: 1e-3 * (0.1 + 0.9 * 0.5)}[steps], rel=1e-9)
    for group in seen["groups"].unique():
        r, adv = seen["rewards"][seen["groups"] == group], seen["advantages"][seen["groups"] == group]
        if overrides.get("scale_adv_by_std", True) and r.std() > 0:  # (r - mean) / (std + 1e-4): unit spread
            assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6) and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
        elif r.std() > 0:  # Dr. GRPO: r - mean, unscaled
            assert torch.equal(adv, r - r.mean())
        else:
            assert torch.equal(adv, torch.zeros_like(adv))
    lengths = record["completion_lengths"]["ar"]  # what `tandem simulate --rollout` replays
    assert len(lengths) == trainer.cfg.prompts_per_step * trainer.cfg.group_size and sum(lengths) == record["rollout_tokens"]["ar"]
    if steps == 1:  # one pass from the sampling policy: the entropy is its own, and no ratio is clipped
        assert record["entropy"] == pytest.approx(seen["entropy"], rel=1e-5) and record["clip_fraction"] == 0.0
    if "kl_coef" in overrides:  # the reference is the initial policy, and step 0 is on-policy: KL 0 up to rounding
        assert trainer.learner.reference is not None and record["skipped_samples"] == 0 and record["kl"] == pytest.approx(0.0, abs=1e-6)


def test_async_update_is_anchored_to_the_proximal_policy(tiny_llama):
    """Each update's mean importance weight is min(exp(proximal - behaviour), cap) over the tokens it trained on, the
    proximal log-probs those of the learner as the update starts (computed here by hand before each update)."""
    trainer = tiny_trainer(tiny_llama, ["ar"], async_mode=True, steps=2)
    learner, update, expected = trainer.learner, trainer.learner.update, []

    def update_by_hand_first(rollouts, advantages, step, online=None):
        proximal = learner.logprobs(rollouts).split([len(r.completion_ids) for r in rollouts])
        trained = [i for i in range(len(rollouts)) if float(advantages[i]) != 0.0]  # zero-advantage samples are skipped
        behaviour = torch.tensor([lp for i in trained for lp in rollouts[i].logprobs])
        weights = torch.exp(torch.cat([proximal[i] for i in trained]) - behaviour).clamp(max=trainer.cfg.behaviour_cap)
        expected.append(float(weights.mean()))
        return update(rollouts, advantages, step, online)

    learner.update = update_by_hand_first
    history = trainer.run()
    assert [h["sample_staleness"] for h in history] == [0, 1]
    assert [h["importance_mean"] for h in history] == pytest.approx(expected, rel=1e-6, abs=0)
    # step 0 is on-policy (weights 1 up to the engine's rounding); step 1 trained on samples of version 0 with the learner at version 1
    assert expected[0] == pytest.approx(1.0, abs=1e-4) and abs(expected[1] - 1.0) > 1e-3
    assert history[1]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # the ratio is to the learner's own current policy


def test_checkpoint_refuses_a_changed_config(tiny_llama, tmp_path):
    a = tiny_trainer(tiny_llama, ["ar"], steps=1)
    a.run()
    save_checkpoint(a, tmp_path / "ckpt")
    with pytest.raises(TandemError, match="lr"):
        load_checkpoint(tiny_trainer(tiny_llama, ["ar"], steps=1, lr=2e-3), tmp_path / "ckpt")
    longer = tiny_trainer(tiny_llama, ["ar"], steps=3)  # more steps is an extension, not a change
    load_checkpoint(longer, tmp_path / "ckpt")
    assert longer.step_index == 1
