"""The online trainer: loss terms switch, training helps, checkpoints resume, a crash leaves serving intact."""
import json
import random

import pytest
import torch

from tandem.errors import InvalidParameterError, TandemError
from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.objective import flywheel_loss
from tandem.flywheel.trainer import (FlywheelConfig, OnlineTrainer, latest_checkpoint, load_target_tables, rest_after, save_target_tables, target_lm_rows,
                                     trainer_copy, wait_for)
from tandem.flywheel.weights import HotSwapper, WeightStore
from tandem.models.eagle import copy_head, load_eagle, save_eagle, target_to_draft
from tandem.models.head_state import make_trainable

from flywheel_helpers import GREEDY, eagle_engine, make_prompts, plain_outputs, save_shared_head, served_traces


@pytest.fixture(scope="module")
def traces(target):
    return served_traces(target, n=6, seed=1)


def make_trainer(target, traces, drafter_path=None, **cfg):
    head = eagle_engine(target, drafter_path=drafter_path).drafter.head
    buffer = TraceBuffer()
    for trace in traces:
        buffer.put(trace)
    return OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), buffer, WeightStore(), FlywheelConfig(**cfg))


def test_loss_terms_switch_on_and_off(target, traces):
    trainer = make_trainer(target, traces)
    gen = torch.Generator().manual_seed(0)
    _, parts = flywheel_loss(trainer.head, trainer.target_rows, traces, trainer.cfg, gen)
    to_draft = target_to_draft(trainer.head.draft_to_target, trainer.head.cfg.target_vocab_size)
    scorable = sum(int(((to_draft[t.reject_token] >= 0) & (t.reject_depth < trainer.cfg.unroll)).sum()) for t in traces)
    assert {"imitation", "discard", "branch"} <= set(parts) and parts["rejections"] == scorable > 0  # greedy: every rejection, r = 1
    _, parts = flywheel_loss(trainer.head, trainer.target_rows, traces, FlywheelConfig(discard_weight=0.0, branch_weight=0.0), gen)
    assert set(parts) == {"imitation", "rejections"}
    _, parts = flywheel_loss(trainer.head, trainer.target_rows, traces, FlywheelConfig(imitation=False, branch_weight=0.0), gen)
    assert set(parts) == {"discard", "rejections"}
    with pytest.raises(InvalidParameterError):
        FlywheelConfig(imitation=False, discard_weight=0.0, branch_weight=0.0)


def test_discard_term_lowers_the_rejected_tokens_probability(target, traces):
    trainer = make_trainer(target, traces, imitation=False, branch_weight=0.0, discard_weight=1.0, lr=3e-3, publish_every=1000)
    gen = torch.Generator().manual_seed(0)
    before, _ = flywheel_loss(trainer.head, trainer.target_rows, traces, trainer.cfg, gen)
    for _ in range(10):
        trainer.train_step()
    after, _ = flywheel_loss(trainer.head, trainer.target_rows, traces, trainer.cfg, torch.Generator().manual_seed(0))
    assert float(after.detach()) < float(before.detach())


@pytest.mark.parametrize("terms", [{}, {"imitation": False, "branch_weight": 0.0, "discard_weight": 1.0}])
def test_a_step_is_one_clipped_adamw_step_on_the_loss_of_the_drawn_batch(target, traces, terms):
    """train_step written out by hand: the batch drawn by the trainer's seeded rng from the buffer (oldest first), the
    flywheel loss of that batch, gradients clipped to norm 1, one AdamW step at the warmed-up lr. Two steps (the
    second at twice the first's lr) must give the same loss and the same weights bit for bit; then every 5th step
    publishes."""
    trainer = make_trainer(target, traces, lr=3e-3, publish_every=5, warmup=4, **terms)
    reference = make_trainable(copy_head(trainer.head))
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    for step in (1, 2):
        batch = [rng.choice(traces) for _ in range(4)]
        loss, _ = flywheel_loss(reference, trainer.target_rows, batch, trainer.cfg, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.param_groups[0]["lr"] = 3e-3 * step / 4
        optimizer.step()
        assert trainer.train_step()["loss"] == float(loss.detach())
        assert len(trainer.params) == len(params) and all(torch.equal(p, q) for p, q in zip(trainer.params, params))
    for _ in range(13):
        trainer.train_step()
    assert trainer.published == 3 and trainer.store.latest().version == 3


def test_batches_come_from_the_whole_buffer(target, traces, monkeypatch):
    """600 traces: each batch is drawn uniformly from all of them, so the oldest 88 (beyond the newest 512 the trainer
    used to see) are drawn too."""
    import dataclasses

    import tandem.flywheel.trainer as trainer_module

    trainer = make_trainer(target, [], publish_every=1000)
    for i in range(600):
        trainer.buffer.put(dataclasses.replace(traces[i % len(traces)], request_id=str(i)))
    drawn = []
    monkeypatch.setattr(trainer_module, "flywheel_loss", lambda head, rows, batch, cfg, gen: (drawn.extend(int(t.request_id) for t in batch) or head.fc.weight.sum() * 0.0, {}))
    for _ in range(50):
        trainer.train_step()
    rng = random.Random(0)  # the trainer's (seed 0): a batch is 4 uniform draws from all 600, oldest first
    expected = [rng.choice(range(600)) for _ in range(200)]
    assert min(expected) < 88 and drawn == expected and len(trainer.buffer) == 600


def test_the_trainer_rests_to_keep_its_duty_share():
    assert rest_after(0.2, 1.0) == 0.0 and rest_after(0.2, 0.5) == pytest.approx(0.2) and rest_after(0.3, 0.25) == pytest.approx(0.9)
    trainer = OnlineTrainer.__new__(OnlineTrainer)
    with pytest.raises(InvalidParameterError, match="duty"):
        OnlineTrainer.start(trainer, duty=0.0)


def test_waits_for_traces():
    trainer = OnlineTrainer.__new__(OnlineTrainer)
    trainer.buffer, trainer.cfg = TraceBuffer(), FlywheelConfig(min_traces=2)
    assert OnlineTrainer.train_step(trainer) is None


def test_the_anchor_pulls_each_step_toward_the_starting_weights_and_survives_a_resume(target, traces, tmp_path):
    free, anchored = make_trainer(target, traces, lr=1e-3, warmup=1), make_trainer(target, traces, lr=1e-3, warmup=1, anchor=200.0)
    start = [p.detach().clone() for p in anchored.params]
    free.train_step()
    anchored.train_step()
    for p, q, s in zip(free.params, anchored.params, start):  # same batch, same Adam step, then the pull
        torch.testing.assert_close(q, p - 1e-3 * 200.0 * (p - s))
    assert any(not torch.equal(p, q) for p, q in zip(free.params, anchored.params))
    anchored.save_checkpoint(tmp_path / "ckpt")
    resumed = OnlineTrainer.resume(tmp_path / "ckpt", target, anchored.buffer, WeightStore(), anchored.cfg)
    for a, s in zip(resumed.anchor, start):  # the head training started from, not the resumed weights
        assert torch.equal(a, s)
    with pytest.raises(InvalidParameterError, match="anchor"):
        FlywheelConfig(lr=1e-2, anchor=100.0)


def test_checkpoint_resumes_optimizer_state(target, traces, tmp_path):
    trainer = make_trainer(target, traces, publish_every=100)
    for _ in range(3):
        trainer.train_step()
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = OnlineTrainer.resume(tmp_path / "ckpt", target, trainer.buffer, WeightStore(), trainer.cfg)
    assert resumed.steps == 3
    for a, b in zip(trainer.head.parameters(), resumed.head.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(trainer.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # both take the same next step
    trainer.rng, resumed.rng = random.Random(5), random.Random(5)
    trainer.generator.manual_seed(5)
    resumed.generator.manual_seed(5)
    trainer.train_step()
    resumed.train_step()
    for a, b in zip(trainer.head.parameters(), resumed.head.parameters()):
        torch.testing.assert_close(a, b)
    (latest_checkpoint(tmp_path / "ckpt") / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(TandemError):
        OnlineTrainer.resume(tmp_path / "ckpt", target, trainer.buffer, WeightStore(), trainer.cfg)


def test_a_shared_lm_head_stays_frozen_through_training(target, traces, tmp_path):
    trainer = make_trainer(target, traces, save_shared_head(target, tmp_path / "head"), lr=1e-3, warmup=1)
    rows = target_lm_rows(target, trainer.head)
    start = trainer.head.fc.weight.detach().clone()
    assert trainer.head.cfg.shared_lm_head and all(p is not trainer.head.lm_head.weight for p in trainer.params)
    for _ in range(2):
        trainer.train_step()
    assert torch.equal(trainer.head.lm_head.weight, rows) and not torch.equal(trainer.head.fc.weight, start)


def test_a_checkpoint_whose_optimizer_also_held_the_shared_lm_head_resumes(target, traces, tmp_path):
    """Trainers before the shared LM head was kept frozen optimised it too (its moments are the checkpoint's last
    entry): such a checkpoint resumes with the LM head frozen and the other moments in place."""
    trainer = make_trainer(target, traces, save_shared_head(target, tmp_path / "head"), publish_every=100, anchor=1.0)
    trainer.head.lm_head.weight.requires_grad_(True)  # what the trainer did before
    trainer.params = [p for p in trainer.head.parameters() if p.requires_grad]
    trainer.anchor = [p.detach().clone() for p in trainer.params]
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=trainer.cfg.lr, weight_decay=trainer.cfg.weight_decay)
    trainer.train_step()
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = OnlineTrainer.resume(tmp_path / "ckpt", target, trainer.buffer, WeightStore(), trainer.cfg)
    assert len(resumed.params) == len(trainer.params) - 1 and not resumed.head.lm_head.weight.requires_grad
    assert torch.equal(resumed.head.lm_head.weight, target_lm_rows(target, resumed.head))
    for p, q in zip(resumed.params, trainer.params):
        assert torch.equal(resumed.optimizer.state[p]["exp_avg"], trainer.optimizer.state[q]["exp_avg"])
    resumed.train_step()
    assert resumed.steps == 2


def test_checkpoint_replacement_is_atomic(target, traces, tmp_path, monkeypatch):
    """A save that dies half way leaves the previous checkpoint in place and resumable; a finished save
    switches to the new one and removes the old."""
    import tandem.flywheel.trainer as trainer_module

    trainer = make_trainer(target, traces, publish_every=100)
    trainer.train_step()
    first = trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.train_step()

    def dies(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trainer_module, "save_eagle", dies)
    with pytest.raises(OSError):
        trainer.save_checkpoint(tmp_path / "ckpt")
    assert latest_checkpoint(tmp_path / "ckpt") == first
    assert OnlineTrainer.resume(tmp_path / "ckpt", target, trainer.buffer, WeightStore(), trainer.cfg).steps == 1
    monkeypatch.undo()
    second = trainer.save_checkpoint(tmp_path / "ckpt")
    assert latest_checkpoint(tmp_path / "ckpt") == second and not first.exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["LATEST", second.name]
    assert OnlineTrainer.resume(tmp_path / "ckpt", target, trainer.buffer, WeightStore(), trainer.cfg).steps == 2


def test_resume_without_a_checkpoint_is_an_error(target, traces, tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(TandemError, match="no trainer checkpoint"):
        OnlineTrainer.resume(tmp_path / "ckpt", target, TraceBuffer(), WeightStore())


def test_a_restore_from_serving_resets_weights_and_moments(target, traces):
    trainer = make_trainer(target, traces, publish_every=1, lr=5e-4, warmup=1)
    trainer.train_step()
    good = trainer.store.latest()
    with torch.no_grad():
        for p in trainer.head.parameters():
            p.add_(1.0)  # what a collapse might have trained into
    assert trainer.request_restore(good) == 1
    trainer.train_step()
    assert trainer.restores == 1 and trainer.store.latest().meta["restores"] == 1
    state = trainer.head.state_dict()
    for name, tensor in good.tensors.items():  # one Adam step (|update| <= ~lr) away from the good weights
        torch.testing.assert_close(state[name], tensor, atol=1.5e-3, rtol=0)
    assert all(int(s["step"]) == 1 for s in trainer.optimizer.state.values())  # fresh moments



def test_a_pending_restore_is_applied_before_a_checkpoint(target, traces, tmp_path):
    trainer = make_trainer(target, traces, publish_every=1)
    trainer.train_step()
    good = trainer.store.latest()
    with torch.no_grad():
        for p in trainer.head.parameters():
            p.add_(1.0)
    trainer.request_restore(good)
    resumed = OnlineTrainer.resume(trainer.save_checkpoint(tmp_path / "ckpt").parent, target, trainer.buffer, WeightStore(), trainer.cfg)
    assert resumed.restores == 1
    for name, tensor in good.tensors.items():
        assert torch.equal(resumed.head.state_dict()[name], tensor)


def test_trainer_crash_leaves_serving_on_the_last_good_weights(target, traces):
    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, background=False).attach(engine)
    trainer = make_trainer(target, traces, publish_every=1)
    trainer.train_step()  # publishes version 1
    calls = []

    def broken_sample(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("trainer died")

    trainer.store = store
    trainer.publish()
    trainer.buffer.sample = broken_sample
    trainer.start()
    assert wait_for(lambda: not trainer.alive, timeout=10)
    assert isinstance(trainer.error, RuntimeError) and calls
    prompts = make_prompts(3, seed=4)
    outputs = [r.output_ids for r in engine.run(prompts, [GREEDY] * 3)]
    assert outputs == plain_outputs(target, prompts, [GREEDY] * 3)
    assert engine.drafter.version == trainer.published  # the last published weights serve on
    assert swapper.stats.swaps == 1


def test_the_child_rebuilds_the_trainers_head_from_the_tables_and_the_saved_head(target, tmp_path):
    head = eagle_engine(target).drafter.head
    save_target_tables(target, tmp_path / "target.safetensors")
    save_eagle(head, tmp_path / "head")
    tables = load_target_tables(tmp_path / "target.safetensors")
    rebuilt, copy = load_eagle(tmp_path / "head", tables), trainer_copy(head)
    assert tables.cfg == target.cfg and torch.equal(target_lm_rows(tables, rebuilt), target_lm_rows(target, head))
    for name, tensor in copy.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name


def test_offline_training_from_spilled_traces(target, traces, tiny_llama, tmp_path):
    from tandem.flywheel.trace_training import train_from_traces
    from tandem.training.offline import TrainConfig

    buffer = TraceBuffer(spill_dir=tmp_path / "traces")
    for trace in traces:
        buffer.put(trace)
    buffer.close()
    report = train_from_traces(TrainConfig(model=tiny_llama, data=str(tmp_path / "traces"), steps=3, draft_vocab=200, out=str(tmp_path / "head")))
    assert report["train_sequences"] + report["heldout_sequences"] == len(traces) and report["steps"] == 3
    assert (tmp_path / "head" / "model.safetensors").exists()


def test_train_cli_dispatches_a_trace_directory(traces, tiny_llama, tmp_path):
    from tandem.cli import main

    buffer = TraceBuffer(spill_dir=tmp_path / "traces")
    for trace in traces:
        buffer.put(trace)
    buffer.close()
    args = ["train", "--model", tiny_llama, "--data", str(tmp_path / "traces"), "--steps", "2", "--draft-vocab", "200"]
    assert main(args + ["--out", str(tmp_path / "head"), "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["train_sequences"] + report["heldout_sequences"] == len(traces) and report["steps"] == 2
