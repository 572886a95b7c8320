"""The small-M fp32 GEMM kernel, the wide (prefill) kernel (tandem.models.cpu_gemm) and the Linear paths that use them."""
import pytest
import torch
import torch.nn.functional as F

from tandem.models import cpu_gemm, decode_glue
from tandem.models.loader import load_transformer
from tandem.models.linear import Linear

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason=f"small-M kernel unavailable: {cpu_gemm.unusable_reason()}")
TOL = 1e-4  # fp32 sums of <= 200 terms of size ~1, in another order than MKL's


def _data(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17, 64, 130])  # <= 16 rows stream one w row at a time, more run in 4 x 3 blocks
@pytest.mark.parametrize("k,n", [(64, 96), (37, 50), (200, 7)])  # K % 8 != 0 and N below one tile exercise the tails
def test_kernel_matches_matmul(m, k, n):
    x, w, b = _data(m, k, n)
    assert (cpu_gemm.small_gemm(x, w) - x @ w.T).abs().max().item() <= TOL
    assert (cpu_gemm.small_gemm(x, w, b) - (x @ w.T + b)).abs().max().item() <= TOL


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("m,k,n", [(1, 8, 16), (9, 40, 48), (12, 64, 33), (17, 576, 200), (60, 581, 101), (131, 576, 90), (20, 7, 9)])
def test_avx512_blocks_give_the_avx2_bits(m, k, n):
    """The AVX-512 blocks (default where the CPU has them) do the AVX2 blocks' FMAs in the same order: the same bits
    for every kernel, rows from the streaming path to the blocked one, K % 8 tails and N tails included."""
    x, w, b = _data(m, k, n, seed=3)
    packed, scale = cpu_gemm.pack_q8(w)
    kernels = (lambda: cpu_gemm.small_gemm(x, w, b), lambda: cpu_gemm.wide_gemm(x, w, b), lambda: cpu_gemm.wide_gemm(x, w),
               lambda: cpu_gemm.small_gemm_q8(x, packed, scale, b), lambda: cpu_gemm.small_gemm_q8(x, packed, scale, None))
    before = cpu_gemm.set_isa("avx2")
    try:
        slow = [f() for f in kernels]
        assert cpu_gemm.set_isa("avx512") == "avx2" and cpu_gemm.isa() == "avx512"
        assert all(torch.equal(a, f()) for a, f in zip(slow, kernels, strict=True))
    finally:
        cpu_gemm.set_isa(before)


@needs_kernel
def test_isa_switch_refuses_unknown_names():
    with pytest.raises(RuntimeError, match="avx2 or avx512"):
        cpu_gemm.set_isa("sse2")


@needs_kernel
@pytest.mark.parametrize("m", [2, 5, 8, 9, 23, 64, 131])  # 23 and more: the blocked path against the streaming one
def test_each_row_is_bit_identical_to_the_row_alone(m):
    """Batch invariance: a k-token verify row equals the single-token step's row bit for bit."""
    x, w, b = _data(m, 576, 200, seed=1)
    together = cpu_gemm.small_gemm(x, w, b)
    for i in range(m):
        assert torch.equal(together[i : i + 1], cpu_gemm.small_gemm(x[i : i + 1], w, b)), i
    assert torch.equal(together[3:], cpu_gemm.small_gemm(x[3:], w, b))


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 6, 7, 17, 64, 131])  # register blocks of 6 rows and the 1-5 row tails
@pytest.mark.parametrize("k,n", [(64, 96), (37, 50), (576, 200), (200, 7)])  # K % 8 != 0, N % 16 != 0, N < 16
def test_wide_kernel_matches_matmul(m, k, n):
    x, w, b = _data(m, k, n, seed=2)
    reference = x.double() @ w.double().T
    assert (cpu_gemm.wide_gemm(x, w).double() - reference).abs().max().item() <= TOL * max(1.0, k / 64)
    assert (cpu_gemm.wide_gemm(x, w, b).double() - (reference + b.double())).abs().max().item() <= TOL * max(1.0, k / 64)


@needs_kernel
def test_wide_kernel_rows_do_not_depend_on_the_other_rows():
    """A prompt's prefill gets the same bits alone, in a padded batch or split into chunks (of > MAX_NEW_TOKENS tokens)."""
    x, w, b = _data(131, 576, 200, seed=3)
    together = cpu_gemm.wide_gemm(x, w, b)
    for rows in (slice(0, 1), slice(5, 6), slice(7, 30), slice(100, 131)):
        assert torch.equal(together[rows], cpu_gemm.wide_gemm(x[rows], w, b)), rows
    assert torch.equal(cpu_gemm.wide_gemm(x.view(1, 131, 576), w, b)[0], together)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("m,k,i", [(1, 8, 8), (40, 37, 25), (137, 576, 48), (13, 64, 7)])  # I % 16 != 0, K % 8 != 0, I < 8
def test_gated_wide_kernel_gives_the_bits_of_the_gemm_then_silu_mul(isa, m, k, i):
    if isa == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 on this CPU")
    x, w, _ = _data(m, k, 2 * i, seed=11)
    x = x * 3  # gate values of both signs, some large
    before = cpu_gemm.set_isa(isa)
    try:
        assert torch.equal(cpu_gemm.wide_gemm_silu(x, w), decode_glue.silu_mul(cpu_gemm.wide_gemm(x, w)))
    finally:
        cpu_gemm.set_isa(before)
    reference = F.silu(x @ w[:i].T) * (x @ w[i:].T)  # and it is the gated MLP's first half
    torch.testing.assert_close(cpu_gemm.wide_gemm_silu(x, w), reference, rtol=1e-3, atol=1e-5 * reference.abs().max().item())
    with pytest.raises(RuntimeError, match="2I"):
        cpu_gemm.wide_gemm_silu(x, w[:-1].contiguous())


@needs_kernel
def test_linear_fuses_the_silu_gate_for_prefill_shaped_inputs_only():
    lin = Linear(32, 48)
    with torch.no_grad():
        lin.weight.normal_()
    lin.pack()
    prefill = torch.randn(2, decode_glue.MAX_NEW_TOKENS + 1, 32)
    decode = torch.randn(3, 4, 32)
    with torch.no_grad():
        assert torch.equal(lin.silu_gated(prefill), cpu_gemm.wide_gemm_silu(prefill, lin.weight))
        assert torch.equal(lin.silu_gated(prefill), decode_glue.silu_mul(lin(prefill)))
        assert torch.equal(lin.silu_gated(decode), decode_glue.silu_mul(cpu_gemm.small_gemm(decode, lin.weight)))  # decode: unfused
    lin.pack(gemm="int8")
    with torch.no_grad():
        assert torch.equal(lin.silu_gated(prefill), decode_glue.silu_mul(lin(prefill)))


def _sdpa_causal(q, k, v):  # q [n, H, D], k, v [Hkv, n, D] -> [n, H D]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@needs_kernel
@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 9, 3, 64), (5, 9, 3, 64), (137, 9, 3, 64), (33, 14, 2, 64), (70, 4, 4, 24), (50, 2, 1, 12)])
def test_prefill_attention_is_causal_attention(n, heads, kv_heads, d):
    g = torch.Generator().manual_seed(n)
    q, k, v = torch.randn(n, heads, d, generator=g), torch.randn(kv_heads, n, d, generator=g), torch.randn(kv_heads, n, d, generator=g)
    out = cpu_gemm.prefill_attention(q, k, v, d ** -0.5)
    torch.testing.assert_close(out, _sdpa_causal(q, k, v), rtol=1e-5, atol=1e-5)
    # causal: the first t rows do not change when later tokens do
    t = max(1, n // 2)
    k2, v2 = k.clone(), v.clone()
    k2[:, t:] += 1.0
    v2[:, t:] -= 1.0
    assert torch.equal(cpu_gemm.prefill_attention(q, k2, v2, d ** -0.5)[:t], out[:t])


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 on this CPU")
def test_prefill_attention_gives_the_same_bits_on_either_isa():
    q, k, v = torch.randn(61, 9, 64), torch.randn(3, 61, 64), torch.randn(3, 61, 64)
    before = cpu_gemm.set_isa("avx2")
    try:
        narrow = cpu_gemm.prefill_attention(q, k, v, 0.125)
    finally:
        cpu_gemm.set_isa(before)
    cpu_gemm.set_isa("avx512")
    try:
        assert torch.equal(cpu_gemm.prefill_attention(q, k, v, 0.125), narrow)
    finally:
        cpu_gemm.set_isa(before)


@needs_kernel
def test_prefill_attention_refuses_bad_input_clearly():
    q, k = torch.randn(10, 9, 64), torch.randn(3, 10, 64)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        cpu_gemm.prefill_attention(torch.randn(10, 8, 64), k, k, 0.125)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_gemm.prefill_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, 0.125)
    with pytest.raises(RuntimeError, match=r"\[Hkv, n, D\]"):
        cpu_gemm.prefill_attention(q, torch.randn(3, 11, 64), torch.randn(3, 11, 64), 0.125)


@needs_kernel
def test_wide_kernel_refuses_bad_input_clearly():
    x, w, _ = _data(20, 16, 8)
    with pytest.raises(RuntimeError, match="wide_gemm"):
        cpu_gemm.wide_gemm(torch.randn(20, 15), w)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_gemm.wide_gemm(x.double(), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_gemm.wide_gemm(x, torch.randn(16, 8).T)


@needs_kernel
def test_kernel_keeps_leading_dims_and_handles_strided_input():
    x, w, _ = _data(6, 48, 40)
    x3 = x.view(2, 3, 48)
    assert cpu_gemm.small_gemm(x3, w).shape == (2, 3, 40)
    strided = torch.randn(48, 6).T  # not contiguous
    assert (cpu_gemm.small_gemm(strided, w) - strided @ w.T).abs().max().item() <= TOL


@needs_kernel
def test_kernel_refuses_bad_input_clearly():
    x, w, _ = _data(2, 16, 8)
    with pytest.raises(RuntimeError, match="features"):
        cpu_gemm.small_gemm(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_gemm.small_gemm(x.double(), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_gemm.small_gemm(x, torch.randn(16, 8).T)


def test_onednn_setting_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "onednn")
    assert cpu_gemm.unusable_reason() == f"{cpu_gemm.ENV}=onednn"


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_model_keeps_one_dense_copy_and_matches(tiny_dirs, arch):
    model = load_transformer(tiny_dirs[arch])
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
    params = {name: p for name, p in model.named_parameters()}
    model.pack()
    for name, lin in model.named_modules():
        if isinstance(lin, Linear):
            assert lin.small_gemm and lin.packed is None and lin.is_packed, name
            assert lin._parameters["weight"] is params.get(name + ".weight", lin._parameters["weight"])  # the same tensor, no copy
    if model.cfg.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
    with torch.inference_mode():
        assert (model(ids).logits - want).abs().max().item() <= TOL
    model.unpack()
    assert not any(lin.is_packed for lin in model.modules() if isinstance(lin, Linear))


@needs_kernel
def test_linear_routes_inputs_by_shape_and_grad_mode():
    lin = Linear(32, 24, bias=True)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.pack()
    assert lin.small_gemm
    big = torch.randn(cpu_gemm.MAX_ROWS + 1, 32)
    with torch.no_grad():
        assert torch.equal(lin(big), F.linear(big, lin.weight, lin.bias))  # past MAX_ROWS: exactly F.linear
        small = torch.randn(3, 32)
        assert torch.equal(lin(small), cpu_gemm.small_gemm(small, lin.weight, lin.bias))
        verify = torch.randn(30, decode_glue.MAX_NEW_TOKENS, 32)  # decode / verify shaped, past MAX_ROWS rows: still the small
        assert verify.shape[0] * verify.shape[1] > cpu_gemm.MAX_ROWS  # kernel (routed by tokens per row, so a row's bits
        assert torch.equal(lin(verify), cpu_gemm.small_gemm(verify, lin.weight, lin.bias))  # do not depend on the batch)
        assert torch.equal(lin(verify)[7], lin(verify[7:8])[0])
        prefill = torch.randn(2, decode_glue.MAX_NEW_TOKENS + 1, 32)  # more tokens per row: the wide kernel
        assert torch.equal(lin(prefill), cpu_gemm.wide_gemm(prefill, lin.weight, lin.bias))
        long_prefill = torch.randn(1, cpu_gemm.MAX_ROWS + 1, 32)  # ... also past MAX_ROWS
        assert torch.equal(lin(long_prefill), cpu_gemm.wide_gemm(long_prefill, lin.weight, lin.bias))
    x = torch.randn(3, 32, requires_grad=True)
    lin(x).sum().backward()  # grad mode, few rows: F.linear, gradients flow
    assert lin.weight.grad is not None and x.grad is not None
    many = torch.randn(2, cpu_gemm.WIDE_MIN_ROWS, 32, requires_grad=True)
    assert torch.equal(lin(many), cpu_gemm.wide_gemm(many.detach(), lin.weight.detach(), lin.bias.detach()))  # many: the wide kernel
    assert lin(many).grad_fn is not None
    lin.unpack()
    with torch.no_grad():  # unpacked inference: the wide kernel for prefill-shaped inputs only, never by rows
        assert torch.equal(lin(many), cpu_gemm.wide_gemm(many, lin.weight, lin.bias))
        decode = torch.randn(40, 1, 32)
        assert torch.equal(lin(decode), F.linear(decode, lin.weight, lin.bias))


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 8, 16), (40, 37, 50), (131, 576, 33), (70, 200, 7)])
def test_wide_kernel_over_an_untransposed_matrix_gives_the_transposed_products_bits(m, k, n):
    x, w, _ = _data(m, k, n)
    b = w.t().contiguous()  # [K, N]
    assert torch.equal(cpu_gemm.wide_gemm_kn(x, b), cpu_gemm.wide_gemm(x, w))
    with pytest.raises(RuntimeError, match="wide_gemm_kn"):
        cpu_gemm.wide_gemm_kn(x, w.t())  # not contiguous


@needs_kernel
@pytest.mark.parametrize("shape,k,n", [((3, 40), 32, 24), ((70,), 581, 101), ((2, 33), 576, 1536)])
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_wide_linear_values_and_gradients_match_f_linear(shape, k, n, frozen_weight):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, k, generator=g)
    w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    grad = torch.randn(*shape, n, generator=g)
    results = []
    for fn in (F.linear, cpu_gemm.linear):
        xs, ws, bs = (t.clone().requires_grad_(not (frozen_weight and t is not x)) for t in (x, w, b))
        y = fn(xs, ws, bs)
        y.backward(grad)
        results.append((y, xs.grad, ws.grad, bs.grad))
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = results
    scale = lambda t: 1e-4 * max(1.0, t.abs().max().item())  # fp32 sums of up to ~600 terms, another order than MKL's
    assert (y1 - y0).abs().max().item() <= scale(y0)
    assert (dx1 - dx0).abs().max().item() <= scale(dx0)
    if frozen_weight:
        assert dw1 is None and db1 is None
    else:
        assert (dw1 - dw0).abs().max().item() <= scale(dw0) * 10  # dW sums over all rows of x
        assert (db1 - db0).abs().max().item() <= scale(db0) * 10


@needs_kernel
def test_weight_change_then_repack_reaches_the_kernel_path(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    reference = load_transformer(tiny_dirs["llama"])
    model.pack()
    with torch.no_grad():  # no dense copy was dropped, so writing the Parameter in place is enough
        model.blocks[0].mlp.down.weight.mul_(2.0)
        reference.blocks[0].mlp.down.weight.mul_(2.0)
    model.pack()
    ids = torch.arange(9).view(1, 9)
    with torch.inference_mode():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() <= TOL


def test_int8_rows_quantize_and_pack_round_trip():
    _, w, _ = _data(1, 100, 70, seed=2)
    q, scale = cpu_gemm.quantize_rows(w)
    want_q, want_scale = cpu_gemm.quantize_rows_reference(w)
    assert torch.equal(scale, want_scale) and (q.int() - want_q.int()).abs().max().item() <= 1  # a rounding tie may differ by one
    assert q.dtype == torch.int8 and (q.float() * scale[:, None] - w).abs().max().item() <= scale.max().item() / 2 + 1e-6
    packed, packed_scale = cpu_gemm.pack_q8(w)
    assert packed.shape == (5, 4, 8, 64)  # 70 rows in blocks of 16, 100 inputs in groups of 32 of 8 lines
    assert torch.equal(cpu_gemm.unpack_q8(packed, packed_scale, w.shape[1]), q) and torch.equal(packed_scale, scale)


@needs_kernel
def test_int8_linear_serves_the_quantized_weight_and_trains_the_dense_one():
    lin = Linear(48, 40, bias=True)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.pack(gemm="int8")
    dequantized = cpu_gemm.dequantize_q8(*lin.int8, 48)
    # every inference input runs the integer kernel: decode, past MAX_ROWS, prefill-shaped (the same bits as decode)
    for x in (torch.randn(3, 48), torch.randn(cpu_gemm.MAX_ROWS + 5, 48), torch.randn(2, decode_glue.MAX_NEW_TOKENS + 3, 48)):
        with torch.no_grad():
            y = lin(x)
        assert torch.equal(y, cpu_gemm.small_gemm_q8(x, *lin.int8, lin.bias))
        exact = F.linear(x, dequantized)  # the int8 activations move it by well under 1 %
        assert ((y - lin.bias - exact).norm() / exact.norm()).item() < 0.01
    x = torch.randn(3, 48, requires_grad=True)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # grad mode: the fp32 Parameter
    lin.unpack()
    assert lin.int8 is None and not lin.is_packed


@needs_kernel
def test_int8_target_is_close_and_takes_updates_through_unpack_write_pack(tiny_dirs):
    model = load_transformer(tiny_dirs["llama"])
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
    model.pack(gemm="int8")
    assert all(lin.int8 is not None and lin.dense_dropped for lin in model.modules() if isinstance(lin, Linear) and lin is not model.lm_head)
    with torch.inference_mode():
        got = model(ids).logits
    assert 0 < (got - want).abs().max().item() <= 0.15 * want.abs().max().item()  # a close, different model (random tiny weights: ~6 %)
    fresh = load_transformer(tiny_dirs["llama"])  # an RL policy update: every weight written, as the engine does it
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    model.unpack()
    model.load_state_dict(fresh.state_dict())
    model.pack(gemm="int8")
    fresh.pack(gemm="int8")
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


@needs_kernel
def test_eagle_head_serves_int8_weights_unless_told_not_to(tiny_llama):
    from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head

    target = load_transformer(tiny_llama)
    cfg = EagleConfig.for_target(target.cfg, 64)
    head = new_eagle_head(target, cfg, draft_vocab_from_tokens([], 64, target.cfg.vocab_size), torch.Generator().manual_seed(0))
    head.pack()
    assert all(lin.int8 is not None for lin in head.linears())
    head.pack(int8=False)
    assert all(lin.int8 is None and lin.small_gemm for lin in head.linears())


@pytest.mark.skipif(not cpu_gemm.available(), reason="needs the CPU kernels")
def test_the_stream_prefetch_distance_is_a_speed_switch_only():
    """set_prefetch (TANDEM_CPU_PREFETCH) changes how far ahead the decode stream prefetches, per CPU kind by default
    (none on Zen 4): every distance gives the same bits, and -1 restores the default."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(3, 581, generator=g), torch.randn(203, 581, generator=g)
    default = cpu_gemm.set_prefetch(-1)
    try:
        reference = cpu_gemm.small_gemm(x, w)
        for ahead in (0, 512, 4096):
            assert cpu_gemm.set_prefetch(ahead) in (default, 0, 512)
            assert torch.equal(cpu_gemm.small_gemm(x, w), reference)
        assert cpu_gemm.set_prefetch(-1) == 4096 and cpu_gemm.set_prefetch(-1) == default
        with pytest.raises(RuntimeError, match="set_prefetch: bytes must be"):
            cpu_gemm.set_prefetch(-5)
    finally:
        cpu_gemm.set_prefetch(-1)


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 24), (2, 40, 24), (70, 24)])  # under WIDE_MIN_ROWS rows: `@`; from it on: the wide kernel
def test_product_nt_is_the_transposed_product_on_the_kernel_that_applies(shape):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(*shape, generator=g), torch.randn(50, 24, generator=g)
    got = cpu_gemm.product_nt(x, w)
    assert got.shape == (*shape[:-1], 50)
    torch.testing.assert_close(got, x @ w.T, rtol=TOL, atol=TOL)
    wide = x.numel() >= cpu_gemm.WIDE_MIN_ROWS * x.shape[-1]
    assert torch.equal(got, cpu_gemm.wide_gemm(x, w) if wide else x @ w.T)


@needs_kernel
def test_product_nt_keeps_the_gradient_where_one_would_flow():
    x = torch.randn(70, 24, requires_grad=True)
    w = torch.randn(50, 24)
    out = cpu_gemm.product_nt(x, w)
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(70, 24), rtol=TOL, atol=TOL)
