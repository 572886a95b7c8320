"""Weights in fewer bytes than fp32 for the decode / verify kernels: group-wise int4 (csrc/q4_gemm.cpp) and bf16
(csrc/bf16_gemm.cpp); int8 rows (cpu_gemm.pack_q8, csrc/q8_gemm.cpp) share int4's activations (`reference_q8`).

- int4 (`pack_q4`): asymmetric, one (scale, min) pair per group of `group_size` inputs of each output row, both fp16
  (llama.cpp Q4_1's numbers): min = the group's smallest weight rounded down to fp16, scale = (max - min) / 15 rounded up,
  q = round((w - min) / scale) in [0, 15] (half to even), weight = fma(q, scale, min), so every weight is within half a
  step (scale / 2) of the fp32 one. 5 bits a weight at groups of 32. Symmetric groups (max |w| / 7, no min) were
  measured first and lost far more (SmolLM2-135M: -0.54 vs -0.03 nats a token; BENCHMARKS 13).
  The kernel runs on integers, as llama.cpp's: each row of x is quantized to int8 per group (`quantize_activations`),
  the dots (q - 8) . xq run on VNNI (AVX2: maddubs + madd), and each group adds scale * d * dot + center * sum(x) with
  center = fma(8, scale, min) in fp32. The centring halves the activations' error against Q4_1 x Q8_1's q . xq form
  (0.5-0.7 % vs 1.1-1.9 % of the fp32-activation product on Gaussian data). `reference_q4` computes the same in fp64.
- bf16 (`pack_bf16`): the fp32 weight rounded to bf16 (round to nearest even), widened back in registers by a 16-bit
  shift (exact): half the bytes of fp32, the bf16 weight's products in fp32 activations.

Every output row is computed in the same order whatever the number of rows of x (1..any), the passes or the ISA (AVX2
or AVX-512 blocks: the same bits), and an int4 row's activation quantization depends on that row only, so a k-token
verify computes exactly what k single-token steps compute: speculation stays lossless w.r.t. the int4 / bf16 model.
The kernels serve every input of a packed Linear in inference (prefill too), so prefill and decode give the same bits.
`dequantize_q4` / `dequantize_bf16` give the fp32 weights (reference path, training-mode forwards: fp32 activations).

Packing is plain torch (no kernel needed); running needs the kernel (cpu_gemm.available()).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.models import cpu_gemm

GROUP_SIZE = 32  # int4 inputs per (scale, min) pair (BENCHMARKS 13: 32 kept SmolLM2 within 0.03 nats, 64 lost 0.3)
Q4_LEVELS = 15  # q in [0, 15]
FP16_MAX = 65504.0
TINY_GROUP = 1e-30  # an activation group with max |x| below this quantizes to zeros (csrc/q4_gemm.cpp's kTinyGroup)


def _check_group_size(group_size: int) -> None:
    if not (isinstance(group_size, int) and group_size >= 8 and group_size % 8 == 0 and (group_size // 8) & (group_size // 8 - 1) == 0):
        raise ValueError(f"group_size must be 8 times a power of two (8, 16, 32, 64, 128, ...), got {group_size!r}")


def _fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:  # x fp32 -> the nearest fp16 on the given side of it
    h = x.half()
    off = h.float() < x if direction > 0 else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction * float("inf"))), h)


def quantize_q4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q uint8 [N, ng * G] in [0, 15], zero-padded in K; scale_min fp16 [N, ng, 2]) with
    weight ~ fma(q, scale, min)."""
    _check_group_size(group_size)
    w = weight.detach().float()
    if w.abs().max().item() > FP16_MAX / 2:
        raise ValueError("int4 groups keep fp16 scales: weights must lie within +-32752")
    n, k = w.shape
    ng = -(-k // group_size)
    grouped = F.pad(w, (0, ng * group_size - k)).view(n, ng, group_size)
    lo = _fp16_toward(grouped.amin(-1), -1.0)  # min <= every weight of the group
    scale = _fp16_toward(((grouped.amax(-1) - lo.float()) / Q4_LEVELS).clamp(min=2.0**-24), 1.0)  # min + 15 scale >= the max
    q = torch.round((grouped - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, Q4_LEVELS).to(torch.uint8)
    return q.view(n, ng * group_size), torch.stack([scale, lo], dim=-1).contiguous()


BLOCK = 16  # rows of w per block of small_gemm_q4's layout (one 32-bit lane each in a 512-bit register)
LINE = 64  # bytes per line: 16 rows x 4 bytes


def pack_q4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_q4 in small_gemm_q4's layout: (uint8 [ceil(N/16), ng, 1 + G/8, 64], row factors fp32 [N] of ones). Per
    block of 16 rows and group: line 0 = the 16 scales then the 16 mins (fp16 bytes); line 1 + c = inputs 8c .. 8c + 7,
    byte 4r + i holding row r's q of input 8c + i in its low nibble and of input 8c + 4 + i in its high one."""
    q, scale_min = quantize_q4(weight, group_size)
    n, _ = q.shape
    nb, ng, chunks = -(-n // BLOCK), scale_min.shape[1], group_size // 8
    q = F.pad(q, (0, 0, 0, BLOCK * nb - n)).view(nb, BLOCK, ng, chunks, 2, 4)  # padding rows: q = 0, scale = min = 0
    lines = q.permute(0, 2, 3, 4, 1, 5)  # [nb, ng, chunks, low / high, 16 rows, 4 inputs]
    lines = (lines[:, :, :, 0] | (lines[:, :, :, 1] << 4)).reshape(nb, ng, chunks, LINE)
    sm = F.pad(scale_min, (0, 0, 0, 0, 0, BLOCK * nb - n)).view(nb, BLOCK, ng, 2).permute(0, 2, 3, 1)  # [nb, ng, 2, 16]
    head = sm.contiguous().view(torch.uint8).reshape(nb, ng, 1, LINE)
    return torch.cat([head, lines], dim=2).contiguous(), torch.ones(n)


def unpack_q4(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q4's layout back to (q uint8 [rows, ng, G], scale_min fp16 [rows, ng, 2])."""
    nb, ng, lines = packed.shape[:3]
    sm = packed[:, :, 0].contiguous().view(torch.float16).view(nb, ng, 2, BLOCK).permute(0, 3, 1, 2)  # [nb, 16, ng, 2]
    body = packed[:, :, 1:]  # [nb, ng, G/8, 64]
    nib = torch.stack([body & 0x0F, body >> 4], dim=3).view(nb, ng, lines - 1, 2, BLOCK, 4)
    q = nib.permute(0, 4, 1, 2, 3, 5).reshape(nb * BLOCK, ng, 8 * (lines - 1))
    return q[:rows], sm.reshape(nb * BLOCK, ng, 2)[:rows]


def dequantize_q4(packed: torch.Tensor, factor: torch.Tensor, in_features: int) -> torch.Tensor:  # -> fp32 [N, K]
    """The fp32 weights small_gemm_q4's integers stand for: fma(q, scale, min), one rounding (computed in fp64, where
    q * scale is exact, then rounded once), times the row factor."""
    q, sm = unpack_q4(packed, factor.numel())
    w = (q.double() * sm[..., 0:1].double() + sm[..., 1:2].double()).float().view(factor.numel(), -1)[:, :in_features]
    return (w * factor[:, None]).contiguous()


def quantize_activations(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What small_gemm_q4 does to x [M, K] before its integer dots (a reference for tests and accuracy studies): per row
    and group, (xq int8 [M, ng, G] = round(x * (127 / max |x|)) half to even, d fp32 [M, ng] = max |x| / 127, the
    group's sum of x [M, ng] (fp64 here; the kernel sums in fp32))."""
    m, k = x.shape
    ng = -(-k // group_size)
    grouped = F.pad(x.float(), (0, ng * group_size - k)).view(m, ng, group_size)
    top = grouped.abs().amax(-1)
    inv = torch.where(top >= TINY_GROUP, torch.tensor(127.0) / top, torch.zeros_like(top))
    xq = torch.round(grouped * inv[..., None]).to(torch.int8)
    return xq, top / 127.0, grouped.double().sum(-1)


def reference_q4(x: torch.Tensor, packed: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """small_gemm_q4's result computed in fp64 from the same integers (x [M, K] -> [M, N]): the sum over groups of
    scale * d * ((q - 8) . xq) + center * sum(x) with center = fma(8, scale, min) in fp32, times the row factor."""
    q, sm = unpack_q4(packed, factor.numel())
    xq, d, xsum = quantize_activations(x, q.shape[2])
    dots = torch.einsum("mjg,njg->mnj", xq.double(), q.double() - 8)  # [M, N, ng]
    scale = sm[..., 0].float()
    center = (8 * scale.double() + sm[..., 1].double()).float().double()  # 8 scale is exact: one fp32 rounding, as fma
    y = (dots * scale.double()[None] * d.double()[:, None, :] + center[None] * xsum[:, None, :]).sum(-1)
    return (y * factor.double()).float()


def reference_q8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cpu_gemm.small_gemm_q8's result from the same integers and float steps (x [M, K] -> [M, N]): per group j in order,
    acc = fma(q . xq, d_j, acc) in fp32 (the exact product in fp64, one rounding to fp32), then acc * scale."""
    k = x.shape[1]
    group_size = 4 * packed.shape[2]
    q = cpu_gemm.unpack_q8(packed, scale, k)
    xq, d, _ = quantize_activations(x, group_size)
    ng = xq.shape[1]
    grouped = F.pad(q, (0, ng * group_size - k)).view(q.shape[0], ng, group_size)
    dots = torch.einsum("mjg,njg->mnj", xq.double(), grouped.double())  # exact: |dot| < 2^19
    acc = torch.zeros(x.shape[0], q.shape[0])
    for j in range(ng):
        acc = (dots[:, :, j] * d[:, j, None].double() + acc.double()).float()
    return acc * scale


def pack_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (bf16 [ceil(N/4), ceil(K/8), 4, 8] in small_gemm_bf16's layout, row factors fp32 [N] of ones)."""
    w = weight.detach().float()
    n, k = w.shape
    n4, c = -(-n // 4), -(-k // 8)
    padded = F.pad(w.to(torch.bfloat16), (0, 8 * c - k, 0, 4 * n4 - n))
    return padded.view(n4, 4, c, 8).permute(0, 2, 1, 3).contiguous(), torch.ones(n)


def dequantize_bf16(packed: torch.Tensor, factor: torch.Tensor, in_features: int) -> torch.Tensor:  # -> fp32 [N, K]
    n4, c = packed.shape[:2]
    rows = packed.permute(0, 2, 1, 3).reshape(4 * n4, 8 * c)[: factor.numel(), :in_features].float()
    return rows * factor[:, None]


def small_gemm_q4(x: torch.Tensor, packed: torch.Tensor, factor: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_q4(packed, scale_min)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_q4(x, packed, factor, bias)


def small_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, factor: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_bf16(packed, factor)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_bf16(x, packed, factor, bias)


KINDS = ("int4", "bf16")


@dataclass(frozen=True)
class Compact:
    """A Linear's weight as int4 or bf16 for the kernels: (packed, scale) as pack_q4 / pack_bf16 give them."""

    kind: str  # "int4" or "bf16"
    packed: torch.Tensor
    scale: torch.Tensor  # fp32 [N] row factors (ones; they name N): int4's scales and mins live in `packed`

    @staticmethod
    def of(weight: torch.Tensor, kind: str, group_size: int = GROUP_SIZE) -> "Compact":
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not cpu_gemm.available():
            raise ValueError(f"gemm {kind!r} needs the CPU kernels, which are not available: {cpu_gemm.unusable_reason() or 'the build failed'}")
        return Compact(kind, *(pack_q4(weight, group_size) if kind == "int4" else pack_bf16(weight)))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # x [..., K] -> [..., N]
        run = small_gemm_q4 if self.kind == "int4" else small_gemm_bf16
        return run(x.float(), self.packed, self.scale, bias)

    def dense(self, in_features: int) -> torch.Tensor:  # fp32 [N, K]: the weights the kernel multiplies by
        undo = dequantize_q4 if self.kind == "int4" else dequantize_bf16
        return undo(self.packed, self.scale, in_features)
