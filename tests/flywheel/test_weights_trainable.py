"""A drafter weight version carries only what training can change: a head's shared (target) LM head is frozen,
so it is never published, saved, validated nor written at install; old version files that carried it still load."""
import pytest
import torch
from safetensors import safe_open

from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
from tandem.flywheel.weights import HotSwapper, WeightStore, WeightVersion, checksum, load_version, save_version, version_files

from flywheel_helpers import GREEDY, eagle_engine, make_prompts, plain_outputs, save_shared_head

TRAINABLE = {"attn.o.weight", "attn.qkv.weight", "draft_to_target", "fc.weight", "hidden_norm.weight", "input_norm.weight",
             "mlp.down.weight", "mlp.gate_up.weight", "mlp_norm.weight", "norm.weight"}
LM_HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def shared_head_dir(target, tmp_path_factory):
    return save_shared_head(target, tmp_path_factory.mktemp("shared") / "head")


def engine_for(target, shared_head_dir, shared=True):
    return eagle_engine(target, drafter_path=shared_head_dir if shared else None)


def trainer_for(target, engine, store):
    head = engine.drafter.head
    return OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), TraceBuffer(), store, FlywheelConfig())


def train_a_little(trainer, seed=0):
    """What training does to the trainer's copy: its trainable parameters move, the frozen LM head does not."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.head.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=gen))


def lm_rows(target, head):  # [Vd, d]: the target's LM-head rows of the head's draft vocabulary
    return target.lm_head.weight.detach().float()[head.draft_to_target.cpu()]


@pytest.mark.parametrize("shared", [True, False])
def test_a_published_version_and_its_file_carry_exactly_the_trainable_tensors(target, shared_head_dir, tmp_path, shared):
    engine = engine_for(target, shared_head_dir, shared)
    assert engine.drafter.head.cfg.shared_lm_head is shared
    trainer = trainer_for(target, engine, WeightStore(directory=tmp_path))
    trainer.publish()
    expected = TRAINABLE if shared else TRAINABLE | {LM_HEAD}  # a head without a shared LM head trains (and publishes) its own
    assert set(trainer.store.latest().tensors) == expected
    [(_, path)] = version_files(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == expected


def test_a_swap_installs_the_trained_tensors_and_never_touches_the_shared_lm_head(target, shared_head_dir, tmp_path):
    engine = engine_for(target, shared_head_dir)
    head = engine.drafter.head
    rows = lm_rows(target, head)
    assert torch.equal(head.lm_head.weight, rows) and head.lm_head.is_packed
    lm_packed = (head.lm_head.int8, head.lm_head.packed, head.lm_head.compact)
    pointers = {k: v.data_ptr() for k, v in head.state_dict().items()}
    before = {k: v.clone() for k, v in head.state_dict().items()}
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, collapse_ratio=0.5, window=4, background=False)
    trainer = trainer_for(target, engine, store)
    swapper.on_rollback = trainer.request_restore
    swapper.observe_lengths(0, [4] * 4)
    train_a_little(trainer)
    trainer.publish()
    published = store.latest()
    swapper()
    assert swapper.stats.refused == 0 and swapper.stats.swaps == 1 and engine.drafter.version == published.version
    state = head.state_dict()
    for name, tensor in published.tensors.items():
        assert torch.equal(state[name], tensor) and state[name].data_ptr() == pointers[name], name
    assert not torch.equal(state["fc.weight"], before["fc.weight"])  # the version did change the head
    assert torch.equal(head.lm_head.weight, rows)  # bit-identical to the target's rows
    assert all(a is b for a, b in zip((head.lm_head.int8, head.lm_head.packed, head.lm_head.compact), lm_packed))  # not even repacked

    swapper.observe_lengths(published.version, [1] * 4)  # collapse: roll back to the weights served before
    swapper()
    assert swapper.stats.rollbacks == 1 and engine.drafter.version == 0
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    trainer.save_checkpoint(tmp_path / "ckpt")  # applies the restore: the trainer continues from the version rolled back to
    assert trainer.restores == 1
    for name, tensor in trainer.head.state_dict().items():
        assert torch.equal(tensor, before[name]), name

    prompts = make_prompts(3, seed=4)  # the swapped-in and rolled-back head still drafts: serving stays lossless
    assert [r.output_ids for r in engine.run(prompts, [GREEDY] * 3)] == plain_outputs(target, prompts, [GREEDY] * 3)


def test_a_version_carrying_the_frozen_lm_head_is_refused_by_name_and_nothing_changes(target, shared_head_dir):
    engine = engine_for(target, shared_head_dir)
    head = engine.drafter.head
    before = {k: v.clone() for k, v in head.state_dict().items()}
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, background=False)
    tensors = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in head.state_dict().items()}  # the old publishers' whole state dict
    store.publish(tensors)
    swapper()
    assert swapper.stats.refused == 1 and swapper.stats.swaps == 0 and engine.drafter.version == 0
    reason = swapper.stats.events[-1]["reason"]
    assert LM_HEAD in reason and "not taken" in reason, reason
    del tensors[LM_HEAD], tensors["fc.weight"]  # and one short of a trainable tensor
    store.publish(tensors)
    swapper()
    assert swapper.stats.refused == 2 and "missing ['fc.weight']" in swapper.stats.events[-1]["reason"]
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_version_file_written_with_the_lm_head_loads_without_it(target, shared_head_dir, tmp_path):
    """Files the code before wrote carry the shared LM head: the reader that knows the head drops it (after the
    file's own checksum passed) and the version installs."""
    engine = engine_for(target, shared_head_dir)
    head = engine.drafter.head
    full = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in head.state_dict().items()}
    path = save_version(WeightVersion(3, full, checksum(full), {"restores": 0}), tmp_path)
    loaded = load_version(path, frozen=(LM_HEAD,))
    assert loaded.version == 3 and loaded.meta == {"restores": 0} and set(loaded.tensors) == TRAINABLE
    assert loaded.checksum == checksum({k: v for k, v in full.items() if k != LM_HEAD})
    assert set(load_version(path).tensors) == TRAINABLE | {LM_HEAD}  # as written, for a reader that keeps it
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, background=False)
    store.publish(loaded.tensors)  # as the admin API's adopt re-publishes a stored version
    swapper()
    assert swapper.stats.swaps == 1 and engine.drafter.version == 1
    assert torch.equal(head.fc.weight, full["fc.weight"]) and torch.equal(head.lm_head.weight, lm_rows(target, head))
