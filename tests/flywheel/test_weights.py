"""Versioned weights: validation refuses bad versions, swaps are in place and between steps, collapse rolls back."""
import time

import pytest
import torch

from tandem.flywheel.trainer import wait_for
from tandem.flywheel import weights
from tandem.flywheel.weights import HotSwapper, PolledWeightStore, WeightRefused, WeightStore, load_version, save_version, validate

from flywheel_helpers import GREEDY, eagle_engine, make_prompts, plain_outputs


def perturbed(head, scale=0.01, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v.clone() for k, v in head.state_dict().items()}


def test_swap_copies_in_place_and_bumps_the_version(target):
    engine = eagle_engine(target)
    head = engine.drafter.head
    pointers = {k: v.data_ptr() for k, v in head.state_dict().items()}
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, background=False)
    published = store.publish(perturbed(head))
    swapper()
    assert engine.drafter.version == published.version == 1 and swapper.stats.swaps == 1
    for name, tensor in head.state_dict().items():
        assert tensor.data_ptr() == pointers[name]  # no re-allocation
        assert torch.equal(tensor, published.tensors[name])


@pytest.mark.parametrize("corrupt", ["nan", "inf", "shape", "checksum", "vocab"])
def test_bad_versions_are_refused(target, corrupt):
    engine = eagle_engine(target)
    head = engine.drafter.head
    before = {k: v.clone() for k, v in head.state_dict().items()}
    store = WeightStore()
    tensors = perturbed(head)
    if corrupt == "nan":
        tensors["fc.weight"][0, 0] = float("nan")
    elif corrupt == "inf":
        tensors["lm_head.weight"][3, 1] = float("inf")
    elif corrupt == "shape":
        tensors["fc.weight"] = tensors["fc.weight"][:-1]
    elif corrupt == "vocab":
        tensors["draft_to_target"] = tensors["draft_to_target"].flip(0)
    version = store.publish(tensors)
    if corrupt == "checksum":
        version.tensors["fc.weight"].add_(1.0)  # changed after publishing
    with pytest.raises(WeightRefused):
        validate(version, head.state_dict())
    swapper = HotSwapper(engine.drafter, store, background=True)
    for _ in range(500):  # background validation: adopted or refused a few calls later
        swapper()
        if swapper.stats.refused:
            break
        time.sleep(0.01)
    assert swapper.stats.refused == 1 and swapper.stats.swaps == 0 and engine.drafter.version == 0
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name])
    swapper.close()


def test_versions_on_disk_round_trip_and_corruption_is_refused(target, tmp_path):
    head = eagle_engine(target).drafter.head
    store = WeightStore(directory=tmp_path)
    version = store.publish(perturbed(head), {"restores": 2, "trainer_step": 7})
    path = next(tmp_path.glob("drafter-v*.safetensors"))
    loaded = load_version(path)
    assert loaded.version == version.version and loaded.checksum == version.checksum
    assert loaded.meta == version.meta and loaded.meta["restores"] == 2  # a trainer in another process gates restores through it
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightRefused):
        load_version(path)
    assert save_version(version, tmp_path).exists()


def test_the_parent_adopts_each_new_version_file_once_and_keeps_its_meta(target, tmp_path):
    head = eagle_engine(target).drafter.head
    publisher, polled = WeightStore(directory=tmp_path), PolledWeightStore(tmp_path)
    polled.directory = tmp_path / "history"  # as the admin API sets it: every adopted version is kept there too
    assert polled.latest() is None
    publisher.publish(head.state_dict(), {"restores": 0})
    second = publisher.publish(head.state_dict(), {"restores": 1})
    assert wait_for(lambda: polled.latest() is not None, timeout=10)
    latest = polled.latest()
    assert latest.version == second.version and latest.meta["restores"] == 1 and latest.checksum == second.checksum
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter-v000002.safetensors", "history"]  # the older file was never needed again
    assert load_version(tmp_path / "history" / "drafter-v000002.safetensors").meta["restores"] == 1
    (tmp_path / "drafter-v000003.safetensors").write_bytes(b"torn")
    assert wait_for(lambda: polled.latest() is not None and polled.unreadable == 1, timeout=10)
    assert polled.latest().version == 2
    polled.close()


def test_a_version_read_from_a_file_is_hashed_once_on_the_serving_side(target, tmp_path, monkeypatch):
    """load_version checks the file's checksum; the swapper's validation then checks names, shapes and finiteness only
    (hashing SmolLM2's head took ~35 ms of the serving core per version, twice). A version published in this process
    is still hashed by the validation (a store's copy changed after publishing is refused: test_bad_versions_are_refused)."""
    engine = eagle_engine(target)
    WeightStore(directory=tmp_path).publish(perturbed(engine.drafter.head))
    polled = PolledWeightStore(tmp_path)
    hashed = []
    real = weights.checksum
    monkeypatch.setattr(weights, "checksum", lambda tensors: hashed.append(1) or real(tensors))
    swapper = HotSwapper(engine.drafter, polled, background=False)
    assert wait_for(lambda: (swapper() or swapper.stats.swaps == 1), timeout=10)
    assert len(hashed) == 1 and engine.drafter.version == 1
    polled.close()


def test_acceptance_collapse_rolls_back_within_the_window(target):
    engine = eagle_engine(target)
    head = engine.drafter.head
    good = {k: v.clone() for k, v in head.state_dict().items()}
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, collapse_ratio=0.5, window=8, background=False)
    swapper.observe_lengths(0, [4] * 8)  # version 0 serves 4 tokens per step
    store.publish(perturbed(head, scale=0.5))
    swapper()
    assert engine.drafter.version == 1
    swapper.observe_lengths(1, [1] * 7)
    assert swapper.stats.alarms == 0  # the window is not full yet
    swapper.observe_lengths(1, [1])
    assert swapper.stats.alarms == 1
    swapper()  # the next between-steps call rolls back
    assert swapper.stats.rollbacks == 1 and engine.drafter.version == 0
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, good[name])
    swapper()  # the collapsed version is never re-adopted
    assert engine.drafter.version == 0


def test_collapse_is_caught_when_the_previous_version_served_little(target):
    """A first version published after only 2 request-steps of serving is still watched against them."""
    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, collapse_ratio=0.5, window=8, background=False)
    swapper.observe_lengths(0, [4, 4])  # fewer than window / 2 samples
    store.publish(perturbed(engine.drafter.head, seed=1))
    swapper()
    swapper.observe_lengths(1, [1] * 8)
    assert swapper.stats.alarms == 1
    swapper()
    assert swapper.stats.rollbacks == 1 and engine.drafter.version == 0


def test_a_rollback_reaches_the_trainer_and_stale_versions_wait(target):
    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, collapse_ratio=0.5, window=4, background=False)
    restored = []
    swapper.on_rollback = lambda version: restored.append(version.version) or 1
    swapper.observe_lengths(0, [3] * 4)
    store.publish(perturbed(engine.drafter.head, seed=1))
    swapper()
    swapper.observe_lengths(1, [1] * 4)
    swapper()  # rollback to version 0, reported to the trainer
    assert restored == [0] and engine.drafter.version == 0
    store.publish(perturbed(engine.drafter.head, seed=2), {"restores": 0})  # trained on from the collapsed weights
    swapper()
    assert engine.drafter.version == 0
    fresh = store.publish(perturbed(engine.drafter.head, seed=3), {"restores": 1})  # after the trainer's restore
    swapper()
    assert engine.drafter.version == fresh.version == 3


def test_healthy_version_is_kept(target):
    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, window=4, background=False)
    swapper.observe_lengths(0, [2] * 4)
    store.publish(perturbed(engine.drafter.head))
    swapper()
    swapper.observe_lengths(1, [2, 3, 2, 2])
    swapper()
    assert swapper.stats.rollbacks == 0 and engine.drafter.version == 1



def test_a_watch_ends_unjudged_when_nothing_is_drafted(target):
    """After a swap the next version waits until the watched one served `window` drafted request-steps; when the speculation
    controller stops drafting there are none, so after UNJUDGED_AFTER x window plain request-steps the watch ends without a
    verdict (the version is not promoted to good: a rollback still goes to the last judged one) and the next version goes in."""
    from types import SimpleNamespace

    from tandem.flywheel.weights import UNJUDGED_AFTER

    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, window=4, background=False)
    plain_step = SimpleNamespace(kind="decode", drafter_version=1, requests=[SimpleNamespace(draft_tokens=[], emitted_tokens=[7])] * 2)
    store.publish(perturbed(engine.drafter.head, seed=1))
    swapper()
    store.publish(perturbed(engine.drafter.head, seed=2))
    for _ in range(UNJUDGED_AFTER * 4 // 2 - 1):  # two plain request-steps each
        swapper.observe(plain_step)
        swapper()
    assert engine.drafter.version == 1 and swapper.stats.unjudged == 0  # still watching version 1
    swapper.observe(plain_step)
    swapper()
    assert engine.drafter.version == 2 and swapper.stats.unjudged == 1 and swapper._good.version == 0

def test_swaps_between_steps_keep_serving_lossless(target):
    """Publish new weights while requests run: they are adopted between steps, each step under one
    version, and greedy output stays identical to plain decoding."""
    prompts = make_prompts(4, seed=3)
    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, window=4).attach(engine)
    versions_seen = []
    engine.observers.append(lambda record: versions_seen.append(record.drafter_version))
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    requests = list(engine.waiting)
    step = 0
    while engine.has_unfinished():
        if step % 3 == 0:
            store.publish(perturbed(engine.drafter.head, seed=step))
        engine.step()
        step += 1
    swapper.close()
    assert swapper.stats.swaps >= 2
    assert sorted(versions_seen) == versions_seen  # versions only move forward, step by step
    assert [r.output_ids for r in requests] == plain_outputs(target, prompts, [GREEDY] * 4)


def test_swap_history_and_per_version_windows_stay_bounded(target):
    from tandem.flywheel.weights import MAX_EVENTS

    engine = eagle_engine(target)
    store = WeightStore()
    swapper = HotSwapper(engine.drafter, store, window=1, background=False)
    versions = MAX_EVENTS + 40
    for i in range(versions):
        store.publish(perturbed(engine.drafter.head, scale=1e-4, seed=i))
        swapper()  # adopts the new version
        swapper.observe_lengths(swapper.stats.version, [3])  # its watch window (1) passes
    assert swapper.stats.swaps == versions and engine.drafter.version == versions
    assert len(swapper.stats.events) == len(swapper.stats.swap_ms) == MAX_EVENTS and swapper.stats.events[-1]["version"] == versions
    assert set(swapper._recent) <= {versions - 1, versions} and swapper.stats.max_swap_ms >= max(swapper.stats.swap_ms)
