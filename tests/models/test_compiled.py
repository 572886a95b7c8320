"""The compiled decode / verify forward equals the eager forward (logits, taps, KV cache, lengths) on every
arch, over ragged batches, padded buckets and tree masks, and does not recompile in steady state."""
import pytest
import torch
from torch._dynamo.utils import counters

from tandem.models.compiled import CompiledForward, bucket, pure_forward
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer

ARCHS = ("llama", "qwen2", "qwen3")
TOL = 1e-4
TREE = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children


def loaded(path):
    model = load_transformer(path)
    model.pack()
    return model


def prefilled_caches(model, lengths=(5, 11), max_len=96):
    gen = torch.Generator().manual_seed(3)
    caches = [KVCache(model.cfg, max_batch=4, max_len=max_len) for _ in range(2)]
    with torch.inference_mode():
        for row, n in enumerate(lengths):
            ids = torch.randint(0, 300, (1, n), generator=gen)
            for cache in caches:
                model(ids, cache=cache, rows=slice(row, row + 1))
    return caches


def step_inputs(caches, width: int, seed: int = 4):
    b = len([n for n in caches[0].lengths.tolist() if n])
    ids = torch.randint(0, 300, (b, width), generator=torch.Generator().manual_seed(seed))
    positions = caches[0].lengths[:b].unsqueeze(1) + torch.arange(width)
    return ids, positions


def assert_same_step(model, compiled, eager_cache, ids, positions, tree_mask, taps=(1,)):
    b = ids.shape[0]
    with torch.inference_mode():
        want = model(ids, positions=positions, cache=eager_cache, rows=slice(0, b), tree_mask=tree_mask, taps=taps)
        got = compiled(ids, positions, tree_mask)
    assert got.logits.shape == want.logits.shape
    assert (got.logits - want.logits).abs().max().item() <= TOL
    assert (got.final_hidden - want.final_hidden).abs().max().item() <= TOL
    assert all((g - w).abs().max().item() <= TOL for g, w in zip(got.hidden, want.hidden, strict=True))
    assert torch.equal(compiled.cache.lengths, eager_cache.lengths)
    n = int(eager_cache.lengths.max())
    assert (compiled.cache.k[:, :b, :, :n] - eager_cache.k[:, :b, :, :n]).abs().max().item() <= TOL
    assert (compiled.cache.v[:, :b, :, :n] - eager_cache.v[:, :b, :, :n]).abs().max().item() <= TOL


def test_buckets():
    assert [bucket(n, 8) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 8]
    assert bucket(0, 512, 64) == 64 and bucket(65, 512, 64) == 128 and bucket(600, 512, 64) == 512


@pytest.mark.parametrize("arch", ARCHS)
def test_bucketing_path_matches_eager_without_inductor(tiny_dirs, arch):
    """Padding, masks, cache writes and taps through dynamo with the eager backend (no C++ build): fast."""
    model = loaded(tiny_dirs[arch])
    compiled_cache, eager_cache = prefilled_caches(model)
    compiled = CompiledForward(model, compiled_cache, taps=(1,), backend="eager")
    ids, positions = step_inputs([compiled_cache], 3)
    assert_same_step(model, compiled, eager_cache, ids, positions, TREE.expand(2, 3, 3))
    assert compiled.eager_calls == 0 and compiled.compiled_shapes == {(2, 3, 64)}


def test_pure_forward_is_the_reference(tiny_dirs):
    """pure_forward run eagerly == the model's forward over the same prefix (what gets compiled is right)."""
    model = loaded(tiny_dirs["qwen3"])
    _, eager_cache = prefilled_caches(model, lengths=(7,))
    ids = torch.tensor([[3, 9]])
    s = 64
    mask = torch.cat([(torch.arange(s) < 7).expand(1, 1, 2, s), torch.ones(2, 2, dtype=torch.bool).tril().expand(1, 1, 2, 2)], dim=-1)
    with torch.inference_mode():
        logits, new_k, _, _, _ = pure_forward(model, ids, torch.tensor([[7, 8]]), eager_cache.k[:, :1, :, :s], eager_cache.v[:, :1, :, :s], mask, ())
        want = model(ids, cache=eager_cache, rows=slice(0, 1))
    assert (logits - want.logits).abs().max().item() <= TOL
    assert (new_k[:, 0] - eager_cache.k[:, 0, :, 7:9].transpose(1, 2)).abs().max().item() <= TOL


@pytest.mark.slow  # the first inductor compile in a process takes ~40 s here (10 s per arch after, with the disk cache)
@pytest.mark.parametrize("arch", ARCHS)
def test_inductor_compiled_matches_eager(tiny_dirs, arch):
    """The real compiled graph (inductor C++), one shape per arch: a ragged batch verifying a 3-node tree."""
    model = loaded(tiny_dirs[arch])
    compiled_cache, eager_cache = prefilled_caches(model)
    compiled = CompiledForward(model, compiled_cache, taps=(1,))
    if not compiled.enabled:
        pytest.skip("no C++ compiler")
    ids, positions = step_inputs([compiled_cache], 3)
    assert_same_step(model, compiled, eager_cache, ids, positions, TREE.expand(2, 3, 3))


def test_no_recompilation_in_steady_state(tiny_dirs):
    model = loaded(tiny_dirs["llama"])
    compiled_cache, eager_cache = prefilled_caches(model, lengths=(5, 9))
    compiled = CompiledForward(model, compiled_cache, backend="eager")
    ids, positions = step_inputs([compiled_cache], 1)
    assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())
    ids, positions = step_inputs([compiled_cache], 2)
    assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())
    graphs = counters["stats"]["unique_graphs"]
    for step in range(16):  # lengths up to 9 + 24 stay in the 64-slot bucket; widths 1 and 2 alternate
        ids, positions = step_inputs([compiled_cache], 1 + step % 2, seed=step)
        assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.compiled_shapes == {(2, 1, 64), (2, 2, 64)}


def test_weight_update_needs_no_recompilation(tiny_dirs):
    model = loaded(tiny_dirs["qwen2"])
    compiled_cache, eager_cache = prefilled_caches(model)
    compiled = CompiledForward(model, compiled_cache, backend="eager")
    ids, positions = step_inputs([compiled_cache], 1)
    assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())
    graphs = counters["stats"]["unique_graphs"]
    model.unpack()
    with torch.no_grad():
        model.blocks[0].mlp.down.weight.mul_(3.0)
    model.pack()
    ids, positions = step_inputs([compiled_cache], 1, seed=9)
    assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())  # new weights are used
    assert counters["stats"]["unique_graphs"] == graphs


def test_too_wide_verify_runs_eager(tiny_dirs):
    model = loaded(tiny_dirs["llama"])
    compiled_cache, eager_cache = prefilled_caches(model)
    compiled = CompiledForward(model, compiled_cache, token_buckets=(1, 2), backend="eager")
    ids, positions = step_inputs([compiled_cache], 3)
    assert_same_step(model, compiled, eager_cache, ids, positions, None, taps=())
    assert compiled.eager_calls == 1
