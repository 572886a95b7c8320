"""EAGLE-3 head and MTP heads: reduced vocabulary, cached inference == training unroll, files, training."""
import json

import pytest
import torch

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.eagle import (
    CONFIG_FILE, EagleConfig, default_taps, draft_vocab_from_tokens, expand_to_target, load_eagle, new_eagle_head,
    resize_draft_vocab, save_eagle, target_to_draft, tree_cache_mask,
)
from tandem.models.eagle_train import attend_within, entry_context, forward_on, unroll, unroll_states
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer
from tandem.models.mtp import MtpConfig, load_mtp, new_mtp_heads, save_mtp
from tandem.models.tiny import make_tiny_model
from tandem.ops.losses import soft_cross_entropy
from tandem.training.offline import eagle_step, mtp_step, target_example

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_transformer(tiny_llama)


def head_for(target, vocab_size=200, seed=0):
    cfg = EagleConfig.for_target(target.cfg, vocab_size)
    vocab = draft_vocab_from_tokens([list(range(50, 250))], vocab_size, target.cfg.vocab_size)
    return new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(seed)).eval()


def sequence(target, length=20, seed=0):
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return target_example(target, ids, 5, default_taps(target.cfg.num_layers))


# ---- reduced vocabulary --------------------------------------------------------------------------------
def test_draft_vocab_is_most_frequent_first_with_low_id_ties_and_tail():
    vocab = draft_vocab_from_tokens([[7, 7, 7, 3, 3, 9], [9, 5]], 6, 20)
    assert vocab.tolist() == [7, 3, 9, 5, 0, 1]  # 3 and 9 tie at 2: lower id first; unseen tail from id 0
    with pytest.raises(InvalidParameterError):
        draft_vocab_from_tokens([[1]], 21, 20)


def test_vocab_maps_invert_and_expanded_probs_are_zero_outside():
    vocab = torch.tensor([7, 3, 9])
    back = target_to_draft(vocab, 10)
    assert back[vocab].tolist() == [0, 1, 2] and (back >= 0).sum() == 3
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    full = expand_to_target(probs, vocab, 10)
    assert full[0, 7] == 0.5 and full[0, 3] == 0.3 and full[0, 9] == 0.2 and full.sum() == pytest.approx(1.0)


def test_head_lm_rows_come_from_the_target(target):
    head = head_for(target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.draft_to_target])


def test_resized_vocabulary_keeps_the_trained_weights_and_takes_target_rows(target):
    cfg = EagleConfig.for_target(target.cfg, 100, shared_lm_head=True)
    vocab = draft_vocab_from_tokens([list(range(50, 150))], 100, target.cfg.vocab_size)
    head = new_eagle_head(target, cfg, vocab, torch.Generator().manual_seed(0)).eval()
    ex = sequence(target)
    ids, feats = ex.tokens[None, 1:], head.fuse(ex.taps.split(target.cfg.hidden_size, -1))[None, :-1]
    logits, hidden = head(ids, feats)
    V = target.cfg.vocab_size
    small, large = resize_draft_vocab(head, 40, target.lm_head.weight), resize_draft_vocab(head, V, target.lm_head.weight)
    assert small.draft_to_target.tolist() == vocab[:40].tolist()
    assert large.draft_to_target[:100].tolist() == vocab.tolist() and sorted(large.draft_to_target.tolist()) == list(range(V))
    for resized in (small, large):
        got, got_hidden = resized(ids, feats)
        assert torch.equal(got_hidden, hidden)
        assert torch.allclose(got, head.norm(hidden) @ target.lm_head.weight[resized.draft_to_target].T, atol=TOL)
    assert torch.allclose(small(ids, feats)[0], logits[..., :40], atol=TOL)
    with pytest.raises(InvalidParameterError):
        resize_draft_vocab(head_for(target), 40, target.lm_head.weight)  # its LM head is trained: rows cannot be swapped
    with pytest.raises(InvalidParameterError):
        resize_draft_vocab(head, V + 1, target.lm_head.weight)


def test_config_validates():
    good = dict(hidden_size=8, target_hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                draft_vocab_size=5, target_vocab_size=10, target_id="x")
    EagleConfig(taps=(0, 1, 2), **good)
    for taps in [(2, 1, 0), (0, 0, 1), (0, 1)]:
        with pytest.raises(InvalidParameterError):
            EagleConfig(taps=taps, **good)
    with pytest.raises(InvalidParameterError):
        EagleConfig(taps=(0, 1, 2), **(good | {"draft_vocab_size": 11}))
    assert default_taps(30) == (2, 15, 27) and default_taps(3) == (0, 1, 2)


# ---- cached inference is what training unrolls ----------------------------------------------------------
def test_cached_chain_matches_training_time_unroll(target):
    """Drafting from root t with the cache (entries 0..t, then fed-back hidden states) equals unroll step s at row t."""
    head, ex = head_for(target), sequence(target)
    steps, length = 3, len(ex.tokens)
    t = length - 1
    fused = head.fuse([ex.taps.unsqueeze(0)[..., : t, :]])
    ids = torch.cat([ex.tokens[1:], torch.zeros(steps - 1, dtype=torch.long)]).unsqueeze(0)
    with torch.no_grad():
        unrolled = unroll(head, ids, fused, steps)
        for root in (4, 11):
            cache = KVCache(head.cfg.layer_config(), 1, 64)
            logits, hidden = head(ids[:, : root + 1], fused[:, : root + 1], cache=cache)
            assert torch.allclose(logits[0], unrolled[0][0, : root + 1], atol=TOL)
            for s in range(1, steps):
                logits, hidden = head(ids[:, root + s : root + s + 1], hidden[:, -1:], cache=cache)
                assert torch.allclose(logits[0, 0], unrolled[s][0, root], atol=TOL)


@pytest.mark.parametrize("packed", [False, True])
def test_cached_head_steps_through_the_fused_glue_match_the_torch_ops(target, packed):
    """A ragged batched catch-up, then chain steps: decode_glue's fused layer (where it applies) against the
    torch-op layer, on the same head, cache contents included."""
    from tandem.models import decode_glue

    if not decode_glue.enabled():
        pytest.skip("the CPU kernels did not build here")
    head = head_for(target)
    if packed:
        head.pack()
    d = head.cfg.hidden_size

    def run(fused: bool):
        head.fused_glue = fused
        cache = KVCache(head.cfg.layer_config(), 3, 64)
        cache.lengths[:] = torch.tensor([0, 3, 5])
        gen = torch.Generator().manual_seed(4)
        outs = []
        with torch.inference_mode():
            logits, hidden = head(torch.randint(0, 256, (3, 6), generator=gen), torch.randn(3, 6, d, generator=gen), cache=cache,
                                  logits_at=torch.tensor([5, 2, 4]))
            outs += [logits, hidden]
            for _ in range(3):
                logits, hidden = head(torch.randint(0, 256, (3, 1), generator=gen), hidden[:, -1:], cache=cache)
                outs += [logits, hidden]
        return outs, cache

    fused, fused_cache = run(True)
    eager, eager_cache = run(False)
    for a, b in zip(fused, eager):
        assert (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())
    assert (fused_cache.k - eager_cache.k).abs().max().item() <= TOL and torch.equal(fused_cache.lengths, eager_cache.lengths)


def test_unrolling_a_sample_of_roots_matches_the_full_unroll(target):
    head, ex = head_for(target), sequence(target)
    t, steps = len(ex.tokens) - 1, 3
    fused = head.fuse([ex.taps[:t].unsqueeze(0)])
    ids = torch.cat([ex.tokens[1:], torch.zeros(steps - 1, dtype=torch.long)]).unsqueeze(0)
    roots = torch.tensor([2, 7, 8, 15])
    with torch.no_grad():
        full = unroll(head, ids, fused, steps)
        sampled = unroll(head, ids, fused, steps, roots)
    assert torch.allclose(sampled[0], full[0], atol=TOL)
    for s in range(1, steps):
        assert torch.allclose(sampled[s][0], full[s][0, roots], atol=TOL)


def test_tree_cache_mask_hides_siblings_and_padding():
    # prefix 2 (row 0) and 3 (row 1); tree entries: a (root child), b (root child), c (child of a)
    ancestors = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    mask = tree_cache_mask(torch.tensor([2, 3]), ancestors, 1)  # the query is c
    assert mask.shape == (2, 1, 1, 6)
    assert mask[0, 0, 0].tolist() == [True, True, True, False, True, False]
    assert mask[1, 0, 0].tolist() == [True, True, True, True, False, True]


# ---- files ---------------------------------------------------------------------------------------------
def test_save_load_round_trip_gives_identical_outputs(target, tmp_path):
    head, ex = head_for(target, seed=3), sequence(target)
    save_eagle(head, tmp_path / "h")
    loaded = load_eagle(tmp_path / "h", target)
    ids = ex.tokens[1:].unsqueeze(0)
    with torch.no_grad():
        fused = head.fuse([ex.taps[:-1].unsqueeze(0)])
        want = head(ids, fused)[0]
        got = loaded(ids, loaded.fuse([ex.taps[:-1].unsqueeze(0)]))[0]
    assert torch.equal(want, got) and torch.equal(head.draft_to_target, loaded.draft_to_target)
    assert not any("embed" in k for k in loaded.state_dict())  # the target's embedding is shared, never saved


def test_loading_for_another_target_is_refused(target, tmp_path):
    save_eagle(head_for(target), tmp_path / "h")
    other = load_transformer(make_tiny_model(tmp_path / "other", "llama", seed=1, num_layers=4))
    with pytest.raises(ModelLoadError, match="trained for target"):
        load_eagle(tmp_path / "h", other)


def test_bad_files_are_refused(target, tmp_path):
    with pytest.raises(ModelLoadError):
        load_eagle(tmp_path / "missing", target)
    save_eagle(head_for(target), tmp_path / "h")
    config = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    (tmp_path / "h" / CONFIG_FILE).write_text(json.dumps(config | {"schema_version": 99}))
    with pytest.raises(ModelLoadError, match="schema"):
        load_eagle(tmp_path / "h", target)


def test_mtp_save_load_round_trip_and_refusal(target, tmp_path):
    vocab = draft_vocab_from_tokens([], 100, target.cfg.vocab_size)
    heads = new_mtp_heads(target, MtpConfig.for_target(target.cfg, 3, 100), vocab)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    save_mtp(heads, tmp_path / "m")
    hidden = torch.randn(2, 5, target.cfg.hidden_size)
    with torch.no_grad():
        assert torch.equal(heads(hidden), load_mtp(tmp_path / "m", target)(hidden))
    other = load_transformer(make_tiny_model(tmp_path / "other", "qwen2", seed=1))
    with pytest.raises(ModelLoadError):
        load_mtp(tmp_path / "m", other)


def test_untrained_mtp_heads_repeat_the_targets_next_token_prediction(target):
    vocab = draft_vocab_from_tokens([], target.cfg.vocab_size, target.cfg.vocab_size)
    heads = new_mtp_heads(target, MtpConfig.for_target(target.cfg, 2), vocab)
    out = target(torch.tensor([[1, 2, 3, 4]]))
    with torch.no_grad():
        logits = heads(out.final_hidden)  # [1, 4, 2, V]: zero residual branch + the target's LM head rows
    assert torch.allclose(logits[:, :, 0][..., target_to_draft(vocab, target.cfg.vocab_size)], out.logits, atol=1e-3)


# ---- training ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_training_steps_lower_the_loss(target, drafter):
    torch.manual_seed(0)
    examples = [sequence(target, 16, seed=s) for s in range(2)]
    if drafter == "eagle":
        module = head_for(target)
        step = lambda: eagle_step(module, rows, examples, unroll=2)  # noqa: E731
    else:
        module = new_mtp_heads(target, MtpConfig.for_target(target.cfg, 2, 200), draft_vocab_from_tokens([], 200, target.cfg.vocab_size))
        step = lambda: mtp_step(module, rows, examples)  # noqa: E731
    rows = target.lm_head.weight.detach()[module.draft_to_target]
    module.train()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    first = step().loss
    for _ in range(5):
        optimizer.zero_grad()
        loss = step().loss
        loss.backward()
        optimizer.step()
    assert step().loss < first - 0.05


def test_eagle_step_loss_is_the_soft_ce_against_the_next_next_token_distribution(target):
    """Step 0 at row t is scored against the target's distribution at position t+1."""
    head, ex = head_for(target), sequence(target, 12)
    rows = target.lm_head.weight.detach()[head.draft_to_target]
    with torch.no_grad():
        stats = eagle_step(head, rows, [ex], unroll=1)
        logits = head(ex.tokens[1:].unsqueeze(0), head.fuse([ex.taps[:-1].unsqueeze(0)]))[0][0]  # [L-1, Vd]
        want = soft_cross_entropy(logits, torch.softmax(ex.final_hidden[1:] @ rows.T, -1))
    assert torch.allclose(stats.loss, want, atol=TOL)


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_train_command_end_to_end(tiny_llama, tmp_path, drafter, capsys):
    """`tandem train` on a prompt file: generates data, trains a few steps, saves a loadable head."""
    import argparse

    from tandem.training.offline import add_train_command

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"domain": d, "prompt": f"{d} prompt number {i}"}) + "\n" for i in range(3) for d in ("code", "sql")))
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers())
    args = parser.parse_args(["train", "--drafter", drafter, "--model", tiny_llama, "--data", str(prompt_file), "--max-prompts", "5",
                              "--max-tokens", "6", "--steps", "3", "--draft-vocab", "64", "--out", str(tmp_path / "head")])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 3 and report["train_sequences"] == 4 and report["heldout_sequences"] == 1
    target = load_transformer(tiny_llama)
    head = load_eagle(tmp_path / "head", target) if drafter == "eagle" else load_mtp(tmp_path / "head", target)
    assert head.draft_to_target.numel() == 64


def test_step_zero_runs_only_the_rows_read_later_with_the_same_logits_and_gradients(target):
    """With first_roots and chain_roots, step 0 computes queries, attention and MLP only at their union (a
    prompt's rows give keys and values only): logits and the gradient of a loss on them are those of the
    full unroll read at the same rows."""
    head, ex = head_for(target), sequence(target)
    t, steps = len(ex.tokens) - 1, 3
    ids = torch.cat([ex.tokens[1:], torch.zeros(steps - 1, dtype=torch.long)]).unsqueeze(0)
    first, chains = torch.arange(9, t), torch.tensor([4, 10, 13, 15])  # root 4 lies outside first_roots (a discard event's root)
    params = [p for p in head.parameters() if p.requires_grad]
    outputs, grads = [], []
    for restricted in (True, False):
        head.zero_grad(set_to_none=True)
        fused = head.fuse([ex.taps[:t].unsqueeze(0)])
        if restricted:
            logits = unroll(head, ids, fused, steps, chains, first)
        else:
            full = unroll(head, ids, fused, steps, chains)
            logits = [full[0][:, first]] + full[1:]
        sum((l.float() ** 2).mean() * (s + 1) for s, l in enumerate(logits)).backward()
        outputs.append([l.detach() for l in logits])
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*outputs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL)
    names = [n for n, p in head.named_parameters() if p.requires_grad]
    assert len(names) == len(grads[0]) == 10 and "fc.weight" in names  # every trainable tensor of the head compared
    assert all(g.abs().sum() > 0 for g in grads[1])  # the loss reaches each of them, so the comparison is not of zeros
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_new_entries_over_a_given_context_match_the_full_masked_pass_with_the_same_gradients(target):
    """forward_on runs the layer at new entries over keys and values computed elsewhere (entry_context): its hidden
    states and the gradient of a loss on them are those of forward() over context and new entries together
    under the same mask, read at the new entries."""
    head, ex = head_for(target), sequence(target)
    t, c = len(ex.tokens) - 1, 12
    ids, positions = ex.tokens[1:].unsqueeze(0), torch.arange(t).unsqueeze(0)
    positions[0, c:] -= 4  # the new entries sit at positions the context also holds, as branch nodes do
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[c:, 4:c] = False  # ... and skip the context entries their branch replaced
    params = [p for p in head.parameters() if p.requires_grad]
    outputs, grads = [], []
    for split in (True, False):
        head.zero_grad(set_to_none=True)
        fused = head.fuse([ex.taps[:t].unsqueeze(0)])
        if split:
            context = entry_context(head, ids[:, :c], fused[:, :c], positions[:, :c])
            hidden = forward_on(head, context, ids[:, c:], fused[:, c:], positions[:, c:], mask[c:])
        else:
            hidden = head(ids, fused, positions, tree_mask=mask.unsqueeze(0), project=False)[1][:, c:]
        (head.norm(hidden).float() ** 2).mean().backward()
        outputs.append(hidden.detach())
        grads.append([p.grad.clone() if p.grad is not None else None for p in params])
    assert outputs[0].shape == (1, t - c, head.cfg.hidden_size) and torch.allclose(outputs[0], outputs[1], atol=TOL)
    reached = [g for g in grads[1] if g is not None]
    assert len(reached) == 9 and all(g.abs().sum() > 0 for g in reached)  # every tensor but the LM head's gets a gradient
    for a, b in zip(*grads):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5, rtol=1e-4))


def test_unroll_states_context_is_the_keys_and_values_of_every_entry(target):
    """The context unroll_states returns is what entry_context computes over the same entries (all T, also with a
    restricted step 0), so the branch pass may extend it."""
    head, ex = head_for(target), sequence(target)
    t, steps = len(ex.tokens) - 1, 3
    ids = torch.cat([ex.tokens[1:], torch.zeros(steps - 1, dtype=torch.long)]).unsqueeze(0)
    with torch.no_grad():
        fused = head.fuse([ex.taps[:t].unsqueeze(0)])
        _, (keys, values) = unroll_states(head, ids, fused, steps, torch.tensor([4, 10]), torch.arange(9, t))
        want_keys, want_values = entry_context(head, ids[:, :t], fused, torch.arange(t).unsqueeze(0))
    assert keys.shape == (1, head.cfg.layer_config().num_kv_heads, t, head.cfg.layer_config().head_dim)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_attention_by_group_equals_the_masked_pass_over_every_column_with_the_same_gradients(target):
    """attend_within with groups (packed traces) runs each group's queries over the columns they see: the output and
    the gradients into queries, keys and values equal one masked pass over all columns (an unused column gets zero)."""
    head = head_for(target)
    cfg = head.attn.cfg
    g = torch.Generator().manual_seed(5)
    sizes, extra = [3, 5, 2], 4  # three packed traces' queries; 4 more key columns nobody sees
    r, c = sum(sizes), sum(sizes) + extra
    group = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    mask = torch.zeros(r, c, dtype=torch.bool)
    start = 0
    for i, n in enumerate(sizes):  # causal within each trace's own block of keys
        mask[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    results = []
    for grouped in (True, False):
        q = torch.randn(1, r, cfg.num_heads, cfg.head_dim, generator=g.manual_seed(1), requires_grad=True)
        k = torch.randn(1, cfg.num_kv_heads, c, cfg.head_dim, generator=g.manual_seed(2), requires_grad=True)
        v = torch.randn(1, cfg.num_kv_heads, c, cfg.head_dim, generator=g.manual_seed(3), requires_grad=True)
        out = attend_within(head, q, k, v, mask, group if grouped else None)
        (out ** 2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert torch.count_nonzero(results[0][2][:, :, r:]) == 0  # the columns no query sees get no gradient
    assert results[0][0].shape == (1, r, target.cfg.hidden_size)
