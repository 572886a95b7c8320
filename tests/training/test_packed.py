"""Feature shards, the packed training-time-test unroll (vs the reference unroll), vocabulary, checkpoints."""
import json
import random
from collections import Counter

import pytest
import torch

from tandem.errors import ModelLoadError
from tandem.models.eagle import EagleConfig, default_taps, draft_vocab_from_tokens, load_eagle, new_eagle_head, save_eagle, target_identity
from tandem.models.eagle_train import unroll
from tandem.models.loader import load_transformer
from tandem.training.features import FeatureDoc, FeatureStream, ShardWriter, pack_documents, read_index, target_features
from tandem.training.packed import packed_loss, packed_unroll
from tandem.training.trainer import TrainState, balanced_vocab, coverage, load_optimizer_tensors, optimizer_tensors, resume, save_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_transformer(tiny_llama)


def head_for(target, vocab_size=200, shared=False):
    cfg = EagleConfig.for_target(target.cfg, vocab_size, shared_lm_head=shared)
    vocab = draft_vocab_from_tokens([list(range(50, 250))], vocab_size, target.cfg.vocab_size)
    return new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(0)).eval()


def feature_doc(target, key, length, prompt_len=4, seed=0, domain="code"):
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    taps, final = target_features(target, ids, default_taps(target.cfg.num_layers))
    return FeatureDoc(key, domain, torch.tensor(ids), prompt_len, taps, final)


def as_dict(doc):
    return {"tokens": doc.tokens, "taps": doc.taps, "final": doc.final, "prompt_len": doc.prompt_len, "domain": 0}


def test_packed_unroll_equals_the_reference_unroll_per_document(target):
    head, steps = head_for(target), 3
    docs = [feature_doc(target, f"d{i}", n, seed=i) for i, n in enumerate((12, 9, 15))]
    batch = next(pack_documents([as_dict(d) for d in docs], rows=2, row_len=24))
    assert batch.segment[0].tolist()[:21] == [1] * 12 + [2] * 9  # first fit: docs 0 and 1 share row 0
    roots = torch.tensor([0, 3, 10, 13, 16])
    with torch.no_grad():
        outputs, indices = packed_unroll(head, batch, steps, roots)
        for doc, row, offset in ((docs[0], 0, 0), (docs[1], 0, 12), (docs[2], 1, 0)):
            t = len(doc.tokens) - 1
            fused = head.fuse([doc.taps[:t].float().unsqueeze(0)])
            ids = torch.cat([doc.tokens[1:], torch.zeros(steps - 1, dtype=torch.long)]).unsqueeze(0)
            reference = unroll(head, ids, fused, steps)
            packed0 = head.lm_head(head.norm(outputs[0][row, offset : offset + t]))
            assert torch.allclose(packed0, reference[0][0], atol=TOL)
            for s in range(1, steps):
                for j, r in enumerate(roots.tolist()):
                    local = r - offset
                    if 0 <= local and local + s + 1 < len(doc.tokens):  # the chain stays inside this document
                        got = head.lm_head(head.norm(outputs[s][row, j]))
                        assert torch.allclose(got, reference[s][0, local], atol=TOL), (s, r)


def test_packed_loss_trains_and_counts_only_answer_positions(target):
    head = head_for(target)
    docs = [feature_doc(target, f"d{i}", 16, prompt_len=10, seed=i) for i in range(2)]
    batch = next(pack_documents([as_dict(d) for d in docs], rows=1, row_len=32))
    rows = target.lm_head.weight.detach().float()[head.draft_to_target]
    loss, stats = packed_loss(head, rows, batch, 2, None)
    # step s counts roots t whose label position t+s+1 is inside the document (<= 15) and whose predicted
    # token t+s+2 is answer text (>= 10): t in [8 - s, 14 - s], 7 roots per document at every step
    assert stats["counted"] == [14, 14]
    loss.backward()
    assert head.fc.weight.grad is not None and torch.isfinite(head.fc.weight.grad).all()


def test_step_weight_weighs_unroll_step_s_by_its_power(target):
    head = head_for(target)
    docs = [feature_doc(target, f"d{i}", 16, prompt_len=10, seed=i) for i in range(2)]
    batch = next(pack_documents([as_dict(d) for d in docs], rows=1, row_len=32))
    rows = target.lm_head.weight.detach().float()[head.draft_to_target]
    with torch.no_grad():
        step0, _ = packed_loss(head, rows, batch, 1, None)
        mean, _ = packed_loss(head, rows, batch, 2, None)
        weighted, _ = packed_loss(head, rows, batch, 2, None, step_weight=0.5)
    step1 = 2 * mean - step0  # the plain mean of two steps
    assert not torch.isclose(step0, step1)
    assert torch.allclose(weighted, (step0 + 0.5 * step1) / 1.5, atol=1e-6)


def test_shards_round_trip_and_resume(target, tmp_path):
    taps, tid = default_taps(target.cfg.num_layers), target_identity(target.cfg)
    docs = [feature_doc(target, f"reference/x/{i}", 10 + i, seed=i, domain=("code", "sql")[i % 2]) for i in range(5)]
    writer = ShardWriter(tmp_path, tid, taps, shard_tokens=25)
    for d in docs[:3]:
        writer.add(d)
    writer.flush()
    with pytest.raises(Exception, match="another process"):
        ShardWriter(tmp_path, tid, taps)  # one writer per directory while the first is open
    writer._lock.close()
    again = ShardWriter(tmp_path, tid, taps)  # a restart sees what was written
    assert all(again.has(d.key) for d in docs[:3]) and not again.has(docs[3].key)
    for d in docs[3:]:
        again.add(d)
    again.flush()
    again._lock.close()
    index = read_index(tmp_path)
    assert sum(s["tokens"] for s in index["shards"]) == sum(len(d.tokens) for d in docs)
    assert sum(s["tokens_per_domain"].get("sql", 0) for s in index["shards"]) == 11 + 13
    stream = FeatureStream([tmp_path], tid)
    seen = {}
    for batch in stream.batches(rows=2, row_len=64, rng=random.Random(0)):
        for r in range(batch.tokens.shape[0]):
            for s in batch.segment[r].unique().tolist():
                if s:
                    where = batch.segment[r] == s
                    seen[tuple(batch.tokens[r, where].tolist())] = batch.taps[r, where]
        if len(seen) == len(docs):
            break
    for d in docs:
        assert torch.equal(seen[tuple(d.tokens.tolist())], d.taps)
    with pytest.raises(Exception, match="features of target"):
        ShardWriter(tmp_path, "another-target", taps)


def test_balanced_vocab_gives_a_small_domain_its_share():
    counts = {"code": Counter({t: 1000 - t for t in range(100)}), "translation": Counter({t: 5 for t in range(200, 210)})}
    vocab = balanced_vocab(counts, 20, 1000)
    assert set(range(200, 210)) <= set(vocab.tolist())  # a frequency-only vocabulary would be all code tokens
    assert coverage(counts, vocab)["translation"] == 1.0


def test_shared_lm_head_is_not_saved_and_is_rebuilt_at_load(target, tmp_path):
    head = head_for(target, shared=True)
    assert not head.lm_head.weight.requires_grad
    save_eagle(head, tmp_path, dtype=torch.float16)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in saved and saved["fc.weight"].dtype == torch.float16
    loaded = load_eagle(tmp_path, target)
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight.detach().float()[head.draft_to_target])
    assert torch.allclose(loaded.fc.weight, head.fc.weight, atol=1e-3)


def test_checkpoint_resume_and_a_corrupt_checkpoint_raises(target, tmp_path):
    head = head_for(target).train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head.fc.weight.sum().backward()
    optimizer.step()
    state = TrainState(step=7, tokens=100)
    save_checkpoint(tmp_path, head, optimizer, state)
    state.step = 9
    final = save_checkpoint(tmp_path, head, optimizer, state)
    assert (tmp_path / "LATEST").read_text() == final.name and len(list(tmp_path.glob("step-*"))) == 2
    back, tensors, groups, got = resume(tmp_path, target)
    assert got.step == 9 and got.tokens == 100 and torch.equal(back.fc.weight, head.fc.weight)
    fresh = torch.optim.AdamW([p for p in back.parameters() if p.requires_grad], lr=1e-3)
    load_optimizer_tensors(fresh, tensors, groups)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    (final / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError):
        resume(tmp_path, target)


def test_exported_head_is_found_for_its_target_and_a_tampered_one_refused(target, tmp_path, monkeypatch):
    import tandem.models.eagle as eagle_module
    from tandem.training.pipeline import export_head

    best = tmp_path / "run" / "best"
    save_eagle(head_for(target, shared=True), best, dtype=torch.float16)
    shipped = tmp_path / "heads"
    export_head(best, shipped / "tiny", "eagle-smollm2")
    monkeypatch.setattr(eagle_module, "SHIPPED_DIR", shipped)
    assert eagle_module.shipped_eagle_path(target.cfg) == shipped / "tiny"
    card = json.loads((shipped / "tiny" / "recipe.json").read_text())
    assert card["recipe"] == "eagle-smollm2" and len(card["sha256"]) == 64
    weights = shipped / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ModelLoadError, match="sha256"):
        eagle_module.shipped_eagle_path(target.cfg)


def test_a_baseline_head_is_never_the_default_drafter(target, tmp_path, monkeypatch):
    """The general head (recipe eagle-smollm2-general) ships beside the strong head and sorts before it
    ("eagle-smollm2-general/" < "eagle-smollm2/"): its card marks it a baseline, so the strong head stays
    the one LLM(drafter="eagle") loads."""
    import tandem.models.eagle as eagle_module
    from tandem.training.pipeline import export_head

    best = tmp_path / "run" / "best"
    save_eagle(head_for(target, shared=True), best, dtype=torch.float16)
    shipped = tmp_path / "heads"
    export_head(best, shipped / "eagle-smollm2-general", "eagle-smollm2-general")
    monkeypatch.setattr(eagle_module, "SHIPPED_DIR", shipped)
    assert json.loads((shipped / "eagle-smollm2-general" / "recipe.json").read_text())["default_drafter"] is False
    assert eagle_module.shipped_eagle_path(target.cfg) is None  # the baseline alone: no default head
    export_head(best, shipped / "eagle-smollm2", "eagle-smollm2")
    assert eagle_module.shipped_eagle_path(target.cfg) == shipped / "eagle-smollm2"


def test_a_copy_of_a_shared_head_trains_without_touching_the_original(target):
    from tandem.flywheel.trainer import trainer_copy

    head = head_for(target, shared=True)
    copy = trainer_copy(head)
    assert torch.equal(copy.lm_head.weight, head.lm_head.weight) and not copy.lm_head.weight.requires_grad
    with torch.no_grad():
        copy.fc.weight.add_(1.0)
    assert not torch.equal(copy.fc.weight, head.fc.weight)


def test_a_waiting_writer_takes_the_directory_when_the_first_lets_go(target, tmp_path):
    import threading

    taps, tid = default_taps(target.cfg.num_layers), target_identity(target.cfg)
    first = ShardWriter(tmp_path, tid, taps)
    first.add(feature_doc(target, "heldout/x/0", 10, seed=0, domain="code"))
    opened = []
    waiter = threading.Thread(target=lambda: opened.append(ShardWriter(tmp_path, tid, taps, wait=True)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not opened  # blocked while the first writer holds the lock
    first.flush()
    first._lock.close()
    waiter.join(timeout=10)
    assert len(opened) == 1 and opened[0].has("heldout/x/0")  # it then sees what the first one wrote


def test_a_features_process_opens_only_the_kinds_it_writes(target, tmp_path):
    from tandem.training.pipeline import feature_writers

    taps, tid = default_taps(target.cfg.num_layers), target_identity(target.cfg)
    ref, _ = feature_writers(tmp_path, ("reference",), tid, taps)  # the reference process holds its directory
    none, regen = feature_writers(tmp_path, ("regenerated",), tid, taps)  # the regenerated one starts beside it
    assert ref is not None and none is None and regen.dir == tmp_path / "features" / "regenerated"
    with pytest.raises(Exception, match="another process"):
        feature_writers(tmp_path, ("reference", "regenerated"), tid, taps)
