"""The CUDA path: compiled forward (inductor + CUDA graphs) == eager on every arch, no recompiles in steady
state, and the engine's greedy identity / sampling with the compiled path on a GPU.

Skipped where no GPU exists (CI); run on a CUDA machine with `pytest tests/cuda`.
"""
import pytest
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.compiled import CompiledForward
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
TOL = 2e-4
TREE = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def exact_matmuls():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 tolerance, as on CPU
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def prefilled(model, lengths=(5, 11), max_len=96):
    gen = torch.Generator().manual_seed(3)
    caches = [KVCache(model.cfg, max_batch=4, max_len=max_len, device=CUDA) for _ in range(2)]
    with torch.inference_mode():
        for row, n in enumerate(lengths):
            ids = torch.randint(0, 300, (1, n), generator=gen).to(CUDA)
            for cache in caches:
                model(ids, cache=cache, rows=slice(row, row + 1))
    return caches


def step(model, compiled, eager_cache, width, tree_mask=None, seed=4):
    b = 2
    ids = torch.randint(0, 300, (b, width), generator=torch.Generator().manual_seed(seed)).to(CUDA)
    positions = (eager_cache.lengths[:b].unsqueeze(1) + torch.arange(width)).to(CUDA)
    mask = None if tree_mask is None else tree_mask.expand(b, -1, -1).to(CUDA)
    with torch.inference_mode():
        want = model(ids, positions=positions, cache=eager_cache, rows=slice(0, b), tree_mask=mask, taps=(1,))
        got = compiled(ids, positions, mask)
    assert (got.logits - want.logits).abs().max().item() <= TOL
    assert all((g - w).abs().max().item() <= TOL for g, w in zip(got.hidden, want.hidden, strict=True))
    assert torch.equal(compiled.cache.lengths, eager_cache.lengths)
    n = int(eager_cache.lengths.max())
    assert (compiled.cache.k[:, :b, :, :n] - eager_cache.k[:, :b, :, :n]).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_compiled_cuda_graphs_match_eager(tiny_dirs, arch):
    model = load_transformer(tiny_dirs[arch], device=CUDA)
    compiled_cache, eager_cache = prefilled(model)
    compiled = CompiledForward(model, compiled_cache, taps=(1,))
    assert compiled.enabled
    for seed, (width, tree) in enumerate([(1, None), (5, None), (3, TREE), (1, None), (1, None), (5, None)]):
        step(model, compiled, eager_cache, width, tree, seed=seed)  # repeats replay the captured graphs
    # the graph's outputs are copied out: a later replay must not change an earlier step's logits
    ids = torch.zeros(2, 1, dtype=torch.long, device=CUDA)
    with torch.inference_mode():
        first = compiled(ids, (compiled.cache.lengths[:2].unsqueeze(1)).to(CUDA)).logits
        kept = first.clone()
        compiled(ids + 1, (compiled.cache.lengths[:2].unsqueeze(1)).to(CUDA))
    assert torch.equal(first, kept)


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "eagle_tree"])
def test_engine_compiled_cuda_greedy_identity_and_sampling(tiny_dirs, name):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (6, 13, 9)]
    plain = Engine(load_transformer(tiny_dirs["llama"], device=CUDA), EngineConfig(max_batch_size=4, max_model_len=128))
    want = [r.output_ids for r in plain.run(prompts, [GREEDY] * 3)]
    target = load_transformer(tiny_dirs["llama"], device=CUDA)
    drafter = build_drafter(name, target=target, num_draft_tokens=4, max_batch=4, max_len=160, device=CUDA, drafter_model=tiny_dirs["llama"])
    engine = Engine(target, EngineConfig(max_batch_size=4, max_model_len=128, compile=True), drafter=drafter)
    assert [r.output_ids for r in engine.run(prompts, [GREEDY] * 3)] == want
    assert engine.compiled is not None and engine.compiled.enabled
    assert name == "ngram" or engine.stats.drafted_tokens > 0  # random prompts may give prompt lookup nothing
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    assert all(len(r.output_ids) == 16 for r in engine.run(prompts, [sampled] * 3))
