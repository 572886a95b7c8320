"""The fused per-layer glue (tandem.models.decode_glue): each op against its torch reference, the fused forward
against the eager one on every architecture, batch invariance, and when it applies."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tandem.models import cpu_gemm, decode_glue
from tandem.models.kv_cache import KVCache
from tandem.models.loader import load_transformer
from tandem.models.transformer import RMSNorm, apply_rope

needs_glue = pytest.mark.skipif(not decode_glue.enabled(), reason="the CPU kernels did not build here")
ARCHS = ("llama", "qwen2", "qwen3")  # qwen2: qkv bias; qwen3: per-head q/k norms
TOL = 1e-4


@needs_glue
def test_norm_ops_match_rmsnorm():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(40, 1e-5)
    norm.weight.data = torch.randn(40, generator=g)
    x, r = torch.randn(3, 2, 40, generator=g), torch.randn(3, 2, 40, generator=g)
    with torch.inference_mode():
        assert (decode_glue.rms_norm(x, norm.weight, norm.eps) - norm(x)).abs().max() <= TOL
        total, normed = decode_glue.add_rms_norm(x, r, norm.weight, norm.eps)
        assert torch.equal(total, x + r)
        assert (normed - norm(x + r)).abs().max() <= TOL


@needs_glue
def test_silu_mul_matches_torch():
    gate_up = torch.randn(2, 3, 2 * 37, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert (decode_glue.silu_mul(gate_up) - F.silu(gate) * up).abs().max() <= TOL


def _attend_reference(qkv, cos, sin, cache_k, cache_v, starts, tree, heads, kv_heads):
    """Eager: RoPE, cache write, and SDPA over [0, start) + the new tokens the tree allows, row by row."""
    b, t, _ = qkv.shape
    d = cache_k.shape[-1]
    outs = []
    for r in range(b):
        q, k, v = qkv[r].view(t, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=1)
        q, k = apply_rope(q.unsqueeze(0), cos[r : r + 1], sin[r : r + 1])[0], apply_rope(k.unsqueeze(0), cos[r : r + 1], sin[r : r + 1])[0]
        s = int(starts[r])
        cache_k[0, r, :, s : s + t], cache_v[0, r, :, s : s + t] = k.transpose(0, 1), v.transpose(0, 1)
        allowed = torch.cat([torch.ones(t, s, dtype=torch.bool), tree[r] if tree is not None else torch.ones(t, t, dtype=torch.bool).tril()], 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), cache_k[0, r, :, : s + t], cache_v[0, r, :, : s + t], attn_mask=allowed, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(t, heads * d))
    return torch.stack(outs)


def _attend_case(d: int, with_tree: bool, heads: int = 4, kv_heads: int = 2):
    g = torch.Generator().manual_seed(d)
    b, t = 3, 4
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(b, t, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    starts = torch.tensor([5, 0, 29])
    tree = None
    if with_tree:
        tree = torch.ones(t, t, dtype=torch.bool).tril().repeat(b, 1, 1)
        tree[0, 3, 1] = tree[2, 2, 1] = False
    shape = (2, b + 1, kv_heads, 40, d)
    return qkv, cos, sin, starts, tree, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@needs_glue
@pytest.mark.parametrize("d", [16, 24, 64, 128])  # 64 / 128: the AVX-512 score loop; 24: a head of 16 n + 8 features
@pytest.mark.parametrize("with_tree", [False, True])
def test_attend_cached_matches_rope_cache_write_and_sdpa(with_tree, d):
    heads, kv_heads = (6, 2) if d == 64 else (4, 2)
    qkv, cos, sin, starts, tree, k0, v0 = _attend_case(d, with_tree, heads, kv_heads)
    ref_k, ref_v, k, v = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    expected = _attend_reference(qkv, cos, sin, ref_k, ref_v, starts, tree, heads, kv_heads)
    got = decode_glue.attend_cached(qkv, cos, sin, None, None, 1e-6, k, v, 0, 0, starts, tree, heads, kv_heads)
    assert (got - expected).abs().max() <= TOL
    assert (k - ref_k).abs().max() <= TOL and torch.equal(v, ref_v)  # the new rotated keys and values, nothing else


@needs_glue
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 here")
@pytest.mark.parametrize("d", [24, 64, 128])
def test_attend_cached_gives_the_same_bits_on_either_isa(d):
    qkv, cos, sin, starts, tree, k0, v0 = _attend_case(d, True, heads=6, kv_heads=2)
    outs = []
    for isa in ("avx2", "avx512"):
        before = cpu_gemm.set_isa(isa)
        try:
            outs.append(decode_glue.attend_cached(qkv, cos, sin, None, None, 1e-6, k0.clone(), v0.clone(), 0, 0, starts, tree, 6, 2))
        finally:
            cpu_gemm.set_isa(before)
    assert torch.equal(outs[0], outs[1])


@needs_glue
def test_attend_cached_refuses_a_write_past_the_cache():
    k = torch.zeros(1, 1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        decode_glue.attend_cached(torch.zeros(1, 2, 24), torch.ones(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), None, None, 1e-6,
                                  k, k.clone(), 0, 0, torch.tensor([3]), None, 1, 1)


def _step_logits(model, fused: bool, batch: int, new: int, ragged: bool, tree: bool, seed: int = 1):
    """Prefill `batch` rows, then one cached forward over `new` tokens (ragged starts, a branching tree)."""
    model.fused_glue = fused
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(model.cfg, batch, 64)
    with torch.inference_mode():
        model(torch.randint(0, 300, (batch, 12), generator=g), cache=cache)
        if ragged:
            cache.lengths[1:] = torch.arange(7, 7 + batch - 1)
        mask = None
        if tree:
            mask = torch.ones(new, new, dtype=torch.bool).tril()
            mask[new - 1, 1] = False
            mask = mask.expand(batch, new, new)
        logits = model(torch.randint(0, 300, (batch, new), generator=g), cache=cache, tree_mask=mask).logits
    return logits, cache


@needs_glue
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch,new,ragged,tree", [(1, 1, False, False), (1, 5, False, False), (3, 1, True, False), (3, 4, True, True)])
def test_fused_forward_matches_eager(tiny_dirs, arch, batch, new, ragged, tree):
    model = load_transformer(tiny_dirs[arch])
    model.pack()
    eager, eager_cache = _step_logits(model, False, batch, new, ragged, tree)
    fused, fused_cache = _step_logits(model, True, batch, new, ragged, tree)
    assert (fused - eager).abs().max() <= TOL * max(1.0, eager.abs().max().item())
    assert (fused_cache.k - eager_cache.k).abs().max() <= TOL and (fused_cache.v - eager_cache.v).abs().max() <= TOL


@needs_glue
def test_a_row_of_a_ragged_verify_is_bit_identical_to_the_row_alone(tiny_dirs):
    """Batch invariance of the whole fused forward (with the small-M GEMM): what makes a verify equal k steps."""
    model = load_transformer(tiny_dirs["llama"])
    model.pack()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (9, 5, 12)]
    new = torch.randint(0, 300, (3, 4), generator=g)
    together_cache, alone = KVCache(model.cfg, 3, 64), []
    with torch.inference_mode():
        for r, p in enumerate(prompts):
            model(p[None], cache=together_cache, rows=slice(r, r + 1))
        together = model(new, cache=together_cache).logits
        for r, p in enumerate(prompts):
            cache = KVCache(model.cfg, 1, 64)
            model(p[None], cache=cache)
            steps = [model(new[r : r + 1, i : i + 1], cache=cache).logits for i in range(4)]  # one token at a time
            alone.append(torch.cat(steps, 1))
    for r in range(3):
        assert torch.equal(together[r : r + 1], alone[r]), r


def test_applies_only_to_cached_short_fp32_inference(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    cache = KVCache(model.cfg, 1, 64)
    x = torch.zeros(1, 3, model.cfg.hidden_size)
    with torch.inference_mode():
        assert decode_glue.applies(x, cache, True)
        assert not decode_glue.applies(x, cache, False)
        assert not decode_glue.applies(x, None, True)
        assert not decode_glue.applies(torch.zeros(1, decode_glue.MAX_NEW_TOKENS + 1, model.cfg.hidden_size), cache, True)
        assert not decode_glue.applies(x.bfloat16(), cache, True)
    assert not decode_glue.applies(x, cache, True)  # grad mode: training keeps the autograd path


@needs_glue
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_prefill_glue_matches_eager(tiny_dirs, arch, cached, rows, monkeypatch):
    """A prefill of > MAX_NEW_TOKENS tokens per row: fused norms / SiLU (in the gate/up GEMM's epilogue), wide GEMMs,
    and for one fresh prompt the prefill attention kernel instead of SDPA, against the torch-op forward."""
    model = load_transformer(tiny_dirs[arch])
    model.pack()
    ids = torch.randint(0, 300, (rows, decode_glue.MAX_NEW_TOKENS + 9), generator=torch.Generator().manual_seed(4))
    kernel, calls = cpu_gemm.prefill_attention, []
    monkeypatch.setattr(cpu_gemm, "prefill_attention", lambda *a: calls.append(1) or kernel(*a))
    outs, caches = [], []
    for fused in (False, True):
        model.fused_glue = fused
        cache = KVCache(model.cfg, 2, 64) if cached else None
        with torch.inference_mode():
            outs.append(model(ids, cache=cache, taps=(0, 1)))
        caches.append(cache)
    assert len(calls) == (model.cfg.num_layers if rows == 1 else 0)  # one fresh prompt: the kernel, once a layer
    eager, fused = outs
    assert (fused.logits - eager.logits).abs().max() <= TOL * max(1.0, eager.logits.abs().max().item())
    for a, b in zip(fused.hidden, eager.hidden):
        assert (a - b).abs().max() <= TOL * max(1.0, b.abs().max().item())
    if cached:
        assert (caches[1].k - caches[0].k).abs().max() <= TOL and (caches[1].v - caches[0].v).abs().max() <= TOL


def test_applies_prefill_only_to_long_fp32_inference():
    long = torch.zeros(1, decode_glue.MAX_NEW_TOKENS + 1, 8)
    with torch.inference_mode():
        assert decode_glue.applies_prefill(long, True)
        assert not decode_glue.applies_prefill(long, False)
        assert not decode_glue.applies_prefill(long[:, : decode_glue.MAX_NEW_TOKENS], True)  # decode / verify: applies()
        assert not decode_glue.applies_prefill(long.bfloat16(), True)
    assert not decode_glue.applies_prefill(long, True)  # grad mode


def test_head_shapes_it_cannot_take_keep_the_torch_glue(tiny_dirs):
    cfg = load_transformer(tiny_dirs["llama"]).cfg
    assert decode_glue.supports(cfg)
    assert not decode_glue.supports(dataclasses.replace(cfg, head_dim=12))
    assert not decode_glue.supports(dataclasses.replace(cfg, num_heads=16 * cfg.num_kv_heads))


def test_off_setting_turns_the_glue_off(monkeypatch):
    monkeypatch.setenv(decode_glue.ENV, "off")
    assert not decode_glue.enabled()


def _step_outputs(model, stack: bool, taps=(0, 1)):
    """Logits, taps and cache after a ragged 3-row, 4-token tree verify, through decode_layers or layer by layer."""
    model.fused_stack = stack
    g = torch.Generator().manual_seed(5)
    cache = KVCache(model.cfg, 3, 64)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[3, 1] = False
    with torch.inference_mode():
        model(torch.randint(0, 300, (3, 10), generator=g), cache=cache)
        cache.lengths[1:] = torch.tensor([6, 8])
        out = model(torch.randint(0, 300, (3, 4), generator=g), cache=cache, tree_mask=mask.expand(3, 4, 4), taps=taps)
    model.fused_stack = True
    return out, cache


@needs_glue
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gemm", ["auto", "int8", "int4", "bf16"])
def test_the_one_call_stack_gives_the_per_layer_bits(tiny_dirs, arch, gemm):
    model = load_transformer(tiny_dirs[arch])
    model.pack(gemm=gemm)
    assert decode_glue.stack_weights(model.blocks, 12) is not None
    stacked, stacked_cache = _step_outputs(model, stack=True, taps=(1, 0))
    layered, layered_cache = _step_outputs(model, stack=False, taps=(1, 0))
    assert torch.equal(stacked.logits, layered.logits)
    assert len(stacked.hidden) == 2 and all(torch.equal(a, b) for a, b in zip(stacked.hidden, layered.hidden))
    assert not torch.equal(stacked.hidden[0], stacked.hidden[1])  # in the order asked for, each its own layer's output
    assert torch.equal(stacked_cache.k, layered_cache.k) and torch.equal(stacked_cache.v, layered_cache.v)


@needs_glue
def test_the_stack_is_used_only_where_every_linear_runs_the_kernel(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    assert decode_glue.stack_weights(model.blocks, 4) is None  # unpacked: plain F.linear
    model.pack()
    weights = decode_glue.stack_weights(model.blocks, 4)
    assert len(weights) == decode_glue.LAYER_WEIGHTS * model.cfg.num_layers
    assert decode_glue.stack_weights(model.blocks, decode_glue.cpu_gemm.MAX_ROWS + 1) is None  # F.linear takes wide inputs
    model.blocks[1].mlp.down.pack(gemm="onednn")
    assert decode_glue.stack_weights(model.blocks, 4) is None


@needs_glue
def test_decode_layers_refuses_a_malformed_weight_list(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    model.pack()
    cache = KVCache(model.cfg, 1, 16)
    x = torch.zeros(1, 1, model.cfg.hidden_size)
    cos, sin = model.rope(torch.zeros(1, 1, dtype=torch.long))
    from tandem.models.kv_cache import build_attention_batch

    batch = build_attention_batch(cache, None, 1, None, 1, x.device)
    weights = decode_glue.stack_weights(model.blocks, 1)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="weights per layer"):
            decode_glue.decode_layers(weights[:-1], x, cos, sin, 1e-5, cache, batch, model.cfg.num_heads, model.cfg.num_kv_heads, ())
        with pytest.raises(RuntimeError, match="tap"):
            decode_glue.decode_layers(weights, x, cos, sin, 1e-5, cache, batch, model.cfg.num_heads, model.cfg.num_kv_heads, (99,))


@needs_glue
def test_the_cached_stack_follows_a_repack(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    model.pack()
    first = decode_glue.stack_weights(model.blocks, 4)
    assert decode_glue.stack_weights(model.blocks, 4) is first  # cached
    model.unpack()
    with torch.no_grad():
        model.blocks[0].mlp.down.weight.mul_(2.0)
    model.pack(gemm="int8")
    again = decode_glue.stack_weights(model.blocks, 4)
    assert again is not first and again[decode_glue.LAYER_WEIGHTS - 1] is not None  # down's int8 scale now
    assert torch.equal(again[11], model.blocks[0].mlp.down.int8[0])
