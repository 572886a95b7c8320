"""The int8, int4 and bf16 weight kernels (cpu_gemm.small_gemm_q8, tandem.models.quant_gemm): values, batch invariance,
ISA invariance, round trips. int8 and int4 run on int8-quantized activations: their values are checked against
`reference_q8` (bit for bit) and `reference_q4` (the same integers in fp64), and their distance from the
fp32-activation product is bounded separately."""
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
    packed, factor = qg.pack_q4(w, group_size)
    return (packed, factor), lambda x: qg.reference_q4(x, packed, factor)


def _bf16(w, group_size):
    packed, factor = qg.pack_bf16(w)
    dense = qg.dequantize_bf16(packed, factor, w.shape[1])
    return (packed, factor), lambda x: x @ dense.T


def _q8(w, group_size):
    packed, scale = cpu_gemm.pack_q8(w, group_size)
    return (packed, scale), lambda x: qg.reference_q8(x, packed, scale)


KERNELS = {"int8": (_q8, cpu_gemm.small_gemm_q8), "int4": (_q4, qg.small_gemm_q4), "bf16": (_bf16, qg.small_gemm_bf16)}


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
def test_kernel_matches_its_reference(kind, k, n, group_size):
    pack, run = KERNELS[kind]
    x, w, b = _data(9, k, n, seed=1)
    operands, reference = pack(w, group_size)
    assert (run(x, *operands, b) - (reference(x) + b)).abs().max().item() <= TOL
    assert (run(x, *operands) - reference(x)).abs().max().item() <= TOL


def test_int4_pack_unpack_round_trip():
    _, w, _ = _data(1, 581, 101, seed=7)
    q, scale_min = qg.quantize_q4(w, 32)
    q2, scale_min2 = qg.unpack_q4(qg.pack_q4(w, 32)[0], 101)
    assert torch.equal(q2, q.view(101, -1, 32)) and torch.equal(scale_min2, scale_min)


def test_activation_quantization_values():
    x = torch.tensor([[2.54, -1.27, 0.0, 0.005, 0.015, -2.54, 1.0, 0.635, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    xq, d, xsum = qg.quantize_activations(x, 8)
    assert xq.tolist() == [[[127, -64, 0, 0, 1, -127, 50, 32], [0] * 8]]  # 1.27 * 50 = 63.5 -> 64 (half to even)
    assert d.tolist() == [[torch.tensor(2.54 / 127.0).item(), 0.0]]
    assert xsum[0, 1].item() == 0.0 and abs(xsum[0, 0].item() - 0.385) < 1e-6


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "avx512"] if has_avx512 else ["avx2"])
def test_int4_on_exact_activations_is_the_exact_product(isa):
    """Integer activations with 127 in every group quantize to themselves (d = 1), and grid weights with power-of-two
    scales make every product exact: the kernel must give x @ w^T to fp32 rounding (layout, nibble order, centring)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (37, 96), generator=g)
    q[:, 2::32], q[:, 3::32] = 15, 0  # each group spans the grid, so quantize_q4 finds these scales and mins
    scale = 2.0 ** torch.randint(-4, 0, (37, 3), generator=g).float()
    w = q.float() * scale.repeat_interleave(32, dim=1) - scale.repeat_interleave(32, dim=1) * 4
    x = torch.randint(-127, 128, (5, 96), generator=g).float()
    x[:, ::32] = 127.0
    packed, factor = qg.pack_q4(w, 32)
    before = cpu_gemm.set_isa(isa)
    try:
        y = qg.small_gemm_q4(x, packed, factor)
    finally:
        cpu_gemm.set_isa(before)
    exact = x.double() @ w.double().T
    assert (y.double() - exact).abs().max().item() <= 1e-6 * exact.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "avx512"] if has_avx512 else ["avx2"])
@pytest.mark.parametrize("k,n,group_size", SHAPES)
def test_int8_kernel_is_its_reference_bit_for_bit(isa, k, n, group_size):
    """The integer dots are exact and the float steps (fma per group, the scale, the bias) are reference_q8's."""
    x, w, b = _data(13, k, n, seed=12)
    packed, scale = cpu_gemm.pack_q8(w, group_size)
    before = cpu_gemm.set_isa(isa)
    try:
        assert torch.equal(cpu_gemm.small_gemm_q8(x, packed, scale, b), qg.reference_q8(x, packed, scale) + b)
        assert torch.equal(cpu_gemm.small_gemm_q8(x, packed, scale), qg.reference_q8(x, packed, scale))
    finally:
        cpu_gemm.set_isa(before)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "avx512"] if has_avx512 else ["avx2"])
def test_int8_on_exact_activations_is_the_exact_product(isa):
    """Integer activations with 127 in every group quantize to themselves (d = 1) and integer weights with 127 in every
    row keep their values (scale 1): the kernel must give x @ w^T exactly. Rows of +-127 against activations of -+127
    are the pairs that saturate AVX2's maddubs if the weights enter offset by 128 (2 * 255 * 127 > 32767)."""
    g = torch.Generator().manual_seed(13)
    w = torch.randint(-127, 128, (37, 96), generator=g).float()
    w[:, 0] = 127.0
    w[:4] = torch.tensor([127.0, -127.0]).repeat(4, 48)
    x = torch.randint(-127, 128, (5, 96), generator=g).float()
    x[:, ::32] = 127.0
    x[0, 1::2], x[1, 1::2] = -127.0, 127.0
    packed, scale = cpu_gemm.pack_q8(w)
    assert torch.equal(scale, torch.ones(37))
    before = cpu_gemm.set_isa(isa)
    try:
        y = cpu_gemm.small_gemm_q8(x, packed, scale)
    finally:
        cpu_gemm.set_isa(before)
    assert torch.equal(y, (x.double() @ w.double().T).float())


@needs_kernel
def test_int8_activation_quantization_costs_under_one_percent():
    """The int8 activations move the product by < 1 % (relative norm) of the fp32-activation product on Gaussian data."""
    x, w, _ = _data(9, 581, 101, seed=9)
    packed, scale = cpu_gemm.pack_q8(w)
    dense = x @ cpu_gemm.dequantize_q8(packed, scale, 581).T
    assert ((cpu_gemm.small_gemm_q8(x, packed, scale) - dense).norm() / dense.norm()).item() < 0.01


@needs_kernel
def test_tiny_activation_groups_quantize_to_zero_not_nan():
    """A group of activations near 1e-38 made 127 / max overflow to inf and its zeros NaN (inf * 0)."""
    x = torch.zeros(2, 64)
    x[0, :32], x[0, 40] = 1e-38, 1.0  # group 0 tiny, group 1 normal
    x[1, 5] = 3e-38
    _, w, _ = _data(1, 64, 20, seed=10)
    packed, factor = qg.pack_q4(w, 32)
    y = qg.small_gemm_q4(x, packed, factor)
    assert torch.isfinite(y).all()
    assert (y - qg.reference_q4(x, packed, factor)).abs().max().item() <= TOL
    packed, scale = cpu_gemm.pack_q8(w)
    y = cpu_gemm.small_gemm_q8(x, packed, scale)
    assert torch.isfinite(y).all() and torch.equal(y, qg.reference_q8(x, packed, scale))


@needs_kernel
def test_int4_activation_quantization_costs_under_one_percent():
    """The int8 activations move the product by < 1 % (relative norm) of the fp32-activation product on Gaussian data
    (measured 0.51-0.66 % with the centred weights; 1.1-1.9 % without centring)."""
    x, w, _ = _data(9, 581, 101, seed=9)
    packed, factor = qg.pack_q4(w, 32)
    dense = x @ qg.dequantize_q4(packed, factor, 581).T
    assert ((qg.small_gemm_q4(x, packed, factor) - dense).norm() / dense.norm()).item() < 0.01


@needs_kernel
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("isa", ["avx2", "avx512"] if has_avx512 else ["avx2"])
@pytest.mark.parametrize("k,n,group_size", [(576, 200, 64), (581, 101, 32), (7, 9, 8)])
def test_each_row_of_m_rows_is_the_bits_of_the_row_alone(kind, isa, k, n, group_size):
    """Batch invariance for M = 1..13 (AVX2 passes of 3 rows (int8, int4: 6), AVX-512 passes of 12: the split points crossed)."""
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


def _wide_pass_reason(kind: str) -> str | None:
    """Why `kind` has no AVX-512 pass on this CPU to compare with its AVX2 pass (None: it has one). int4's is
    VNNI's dpbusd: on AVX-512 without VNNI it runs its AVX2 pass under either ISA setting."""
    from tandem.bench.machine import cpu_flags

    if not has_avx512:
        return "no AVX-512 on this CPU"
    if kind == "int4" and len(cpu_flags(("avx512_vnni", "avx512bw", "avx512vl"))) < 3:
        return "no AVX-512 VNNI (+ BW, VL) on this CPU: the int4 kernel has only its AVX2 pass here"
    return None


@needs_kernel
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("m", [1, 2, 4, 12, 13, 40])
def test_avx512_passes_give_the_avx2_bits(kind, m):
    if _wide_pass_reason(kind):
        pytest.skip(_wide_pass_reason(kind))
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
    packed, factor = qg.pack_q4(w, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        qg.small_gemm_q4(torch.randn(2, 128), packed, factor)
    with pytest.raises(RuntimeError, match="factor must be fp32"):
        qg.small_gemm_q4(x, packed, factor.half())
    bpacked, factor = qg.pack_bf16(w)
    with pytest.raises(RuntimeError, match="bf16"):
        qg.small_gemm_bf16(x, bpacked.float(), factor)
    qpacked, scale = cpu_gemm.pack_q8(w)
    with pytest.raises(RuntimeError, match="small_gemm_q8: weights .* do not fit N = 8, K = 128"):
        cpu_gemm.small_gemm_q8(torch.randn(2, 128), qpacked, scale)
    with pytest.raises(RuntimeError, match="pack_q8's contiguous int8"):
        cpu_gemm.small_gemm_q8(x, qpacked.view(torch.uint8), scale)
    with pytest.raises(ValueError, match="group_size must be 8 times a power of two"):
        cpu_gemm.pack_q8(w, 48)


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
    _, reference = KERNELS[kind][0](dense, qg.GROUP_SIZE)
    assert (y - (reference(x.view(15, 96)).view(3, 5, 40) + lin.bias)).abs().max().item() <= TOL
    assert prefill.shape == (1, 40, 40)
    assert not torch.equal(served, dense) and torch.equal(lin.weight, dense)  # another model; the fp32 weight kept for updates
    grad_y = lin(x)  # training mode: the served weights (fp32 activations), differentiable in x
    assert grad_y.requires_grad and (grad_y - (x @ served.T + lin.bias)).abs().max().item() <= TOL
    assert ((grad_y - y).norm() / y.norm()).item() < (0.01 if kind == "int4" else 1e-6)
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
