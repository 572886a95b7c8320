"""The int4 and bf16 weight kernels (tandem.models.quant_gemm): values, batch invariance, ISA invariance, round trips."""
import pytest
import torch

from tandem.models import cpu_gemm
from tandem.models import quant_gemm as qg
from tandem.models.linear import Linear

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason=f"CPU kernels unavailable: {cpu_gemm.unusable_reason()}")
has_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
TOL = 1e-4  # fp32 sums of <= ~600 terms of size ~1, in another order than MKL's
SHAPES = [(64, 8, 64), (576, 200, 64), (581, 101, 32), (7, 9, 8), (100, 13, 128), (896, 37, 16)]  # (K, N, G): K % 8, N % 4 tails


def _data(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def _q4(w, group_size):
    packed, scale = qg.pack_q4(w, group_size)
    return (packed, scale), qg.dequantize_q4(packed, scale, w.shape[1])


def _bf16(w, group_size):
    packed, factor = qg.pack_bf16(w)
    return (packed, factor), qg.dequantize_bf16(packed, factor, w.shape[1])


KERNELS = {"int4": (_q4, qg.small_gemm_q4), "bf16": (_bf16, qg.small_gemm_bf16)}


@pytest.mark.parametrize("k,n,group_size", SHAPES)
def test_int4_round_trip_is_within_half_a_step_of_each_group(k, n, group_size):
    _, w, _ = _data(1, k, n, seed=2)
    q, scale_min = qg.quantize_q4(w, group_size)
    assert q.max().item() == qg.Q4_LEVELS and q.min().item() == 0  # each group spans [min, min + 15 scale]
    step = scale_min[..., 0].float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]: each weight's group scale
    error = (qg.dequantize_q4(*qg.pack_q4(w, group_size), k) - w).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-5) + 1e-6 * w.abs())  # half a step, plus the fma's own rounding
    assert error.max().item() > step.min().item() / 8  # rounding happened (a wrong scale of 2x or 0.5x breaks the line above)


def test_int4_packing_is_exact_on_representable_weights():
    """Weights already on the grid (q * s + m, q in [0, 15] with both ends in every group, s and m powers of two so that
    fp16 and (max - min) / 15 give them back) come back bit for bit, nibble order and rows included."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (10, 96), generator=g)
    q[:, ::32], q[:, 1::32] = 15, 0
    scale = 2.0 ** torch.randint(-6, 0, (10, 3), generator=g).float()
    low = -(2.0 ** torch.randint(-3, 1, (10, 3), generator=g).float())
    w = q.float() * scale.repeat_interleave(32, dim=1) + low.repeat_interleave(32, dim=1)
    assert torch.equal(qg.dequantize_q4(*qg.pack_q4(w, 32), 96), w)


def test_int4_refuses_weights_beyond_fp16_scales():
    with pytest.raises(ValueError, match="fp16"):
        qg.pack_q4(torch.full((4, 32), 1e5))


def test_bf16_round_trip_is_torch_bf16():
    _, w, _ = _data(1, 37, 11, seed=5)
    assert torch.equal(qg.dequantize_bf16(*qg.pack_bf16(w), 37), w.to(torch.bfloat16).float())


def test_group_size_must_be_eight_times_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        qg.pack_q4(torch.zeros(4, 96), 48)


@needs_kernel
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("k,n,group_size", SHAPES)
def test_kernel_matches_the_dequantized_matmul(kind, k, n, group_size):
    pack, run = KERNELS[kind]
    x, w, b = _data(9, k, n, seed=1)
    operands, dense = pack(w, group_size)
    assert (run(x, *operands, b) - (x @ dense.T + b)).abs().max().item() <= TOL
    assert (run(x, *operands) - x @ dense.T).abs().max().item() <= TOL


@needs_kernel
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("isa", ["avx2", "avx512"] if has_avx512 else ["avx2"])
@pytest.mark.parametrize("k,n,group_size", [(576, 200, 64), (581, 101, 32), (7, 9, 8)])
def test_each_row_of_m_rows_is_the_bits_of_the_row_alone(kind, isa, k, n, group_size):
    """Batch invariance for M = 1..13 (AVX2 passes of 3 rows, AVX-512 passes of 12: both split points crossed)."""
    pack, run = KERNELS[kind]
    x, w, b = _data(13, k, n, seed=3)
    operands, _ = pack(w, group_size)
    before = cpu_gemm.set_isa(isa)
    try:
        alone = [run(x[i : i + 1], *operands, b) for i in range(13)]
        for m in range(1, 14):
            together = run(x[:m], *operands, b)
            assert all(torch.equal(together[i : i + 1], alone[i]) for i in range(m)), m
    finally:
        cpu_gemm.set_isa(before)


@needs_kernel
@pytest.mark.skipif(not has_avx512, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("m", [1, 2, 4, 12, 13, 40])
def test_avx512_passes_give_the_avx2_bits(kind, m):
    pack, run = KERNELS[kind]
    x, w, b = _data(m, 581, 103, seed=6)
    operands, _ = pack(w, 32)
    before = cpu_gemm.set_isa("avx2")
    try:
        slow = run(x, *operands, b)
        cpu_gemm.set_isa("avx512")
        assert torch.equal(run(x, *operands, b), slow)
    finally:
        cpu_gemm.set_isa(before)


@needs_kernel
def test_kernels_refuse_mismatched_operands_clearly():
    x, w, _ = _data(2, 64, 8)
    packed, scale = qg.pack_q4(w, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        qg.small_gemm_q4(torch.randn(2, 128), packed, scale)
    with pytest.raises(RuntimeError, match="scale_min must be fp16"):
        qg.small_gemm_q4(x, packed, scale.float())
    bpacked, factor = qg.pack_bf16(w)
    with pytest.raises(RuntimeError, match="bf16"):
        qg.small_gemm_bf16(x, bpacked.float(), factor)


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_linear_serves_the_compact_weight_and_keeps_the_dense_one(kind):
    torch.manual_seed(0)
    lin = Linear(96, 40, bias=True)
    torch.nn.init.normal_(lin.weight)
    dense = lin.weight.detach().clone()
    lin.pack(gemm=kind)
    assert lin.compact is not None and lin.compact.kind == kind and lin.is_packed
    served = lin.compact.dense(96)
    x = torch.randn(3, 5, 96)
    with torch.no_grad():
        y = lin(x)
        prefill = lin(torch.randn(1, 40, 96))  # prefill-shaped: the same kernel
    assert (y - (x @ served.T + lin.bias)).abs().max().item() <= TOL
    assert prefill.shape == (1, 40, 40)
    assert not torch.equal(served, dense) and torch.equal(lin.weight, dense)  # another model; the fp32 weight kept for updates
    grad_y = lin(x)  # training mode: the served weights, differentiable in x
    assert grad_y.requires_grad and (grad_y - y).abs().max().item() <= TOL
    lin.unpack()
    assert lin.compact is None and torch.equal(lin.weight, dense)


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_without_the_kernels_int4_and_bf16_refuse_clearly(monkeypatch, kind):
    """No dequantized fallback: where the kernels cannot run (TANDEM_CPU_GEMM=onednn, no AVX2) packing says why."""
    monkeypatch.setattr(cpu_gemm, "_loaded", False)
    monkeypatch.setenv(cpu_gemm.ENV, "onednn")
    lin = Linear(32, 8)
    with pytest.raises(ValueError, match=f"gemm '{kind}' needs the CPU kernels.*TANDEM_CPU_GEMM=onednn"):
        lin.pack(gemm=kind)
    assert lin.compact is None
