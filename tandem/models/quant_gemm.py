"""Weights in fewer bytes than fp32 for the decode / verify kernels: group-wise int4 and bf16 (csrc/quant_gemm.cpp).

- int4 (`pack_q4`): asymmetric, one (scale, min) pair per group of `group_size` inputs of each output row, both fp16
  (llama.cpp Q4_1's numbers): min = the group's smallest weight rounded down to fp16, scale = (max - min) / 15 rounded up,
  q = round((w - min) / scale) in [0, 15] (half to even), weight = fma(q, scale, min) in fp32, so every weight is within
  half a step (scale / 2) of the fp32 one. 5 bits a weight at groups of 32. Symmetric groups (max |w| / 7, no min) were
  measured first and lost far more (SmolLM2-135M: -0.54 vs -0.03 nats a token; BENCHMARKS 13).
- bf16 (`pack_bf16`): the fp32 weight rounded to bf16 (round to nearest even), widened back in registers by a 16-bit
  shift (exact): half the bytes of fp32, the bf16 weight's products in fp32.

Both are stored interleaved in groups of 4 rows (as pack_q8: one sequential stream feeds 4 FMA chains) and run by
one small-M kernel each, with fp32 activations and accumulation. Every output row is summed in the same order
whatever the number of rows of x (1..any), the passes or the ISA (AVX2 or AVX-512 blocks: the same bits), so a k-token
verify computes exactly what k single-token steps compute: speculation stays lossless w.r.t. the int4 / bf16 model.
The kernels serve every input of a packed Linear in inference (prefill too: 12 rows of x per pass on AVX-512, each
weight widened once per pass), so prefill and decode give the same bits. `dequantize_q4` / `dequantize_bf16` give
the fp32 weights the kernels multiply by (reference path, training-mode forwards).

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


def pack_q4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_q4 in small_gemm_q4's layout: (uint8 [ceil(N/4), ng, G/8, 16], scale_min fp16 [N, ng, 2]). In each chunk
    of 8 inputs of 4 rows, byte i holds row i // 8's weight i % 8 in its low nibble and row 2 + i // 8's in its high one."""
    q, scale_min = quantize_q4(weight, group_size)
    n, _ = q.shape
    n4, ng = -(-n // 4), scale_min.shape[1]
    nib = F.pad(q, (0, 0, 0, 4 * n4 - n))  # padding rows: q = 0 (their scale and min read as 0)
    chunks = nib.view(n4, 4, ng, group_size // 8, 8).permute(0, 2, 3, 1, 4)  # [n4, ng, G/8, 4 rows, 8 k]
    packed = chunks[..., :2, :] | (chunks[..., 2:, :] << 4)  # rows 0-1 in the low nibbles, rows 2-3 in the high ones
    return packed.reshape(n4, ng, group_size // 8, 16).contiguous(), scale_min


def dequantize_q4(packed: torch.Tensor, scale_min: torch.Tensor, in_features: int) -> torch.Tensor:  # -> fp32 [N, K]
    """The fp32 weights small_gemm_q4 multiplies by: fma(q, scale, min), one rounding (computed in fp64, where q * scale
    is exact, then rounded once)."""
    n4, ng, chunks = packed.shape[:3]
    n, group_size = scale_min.shape[0], 8 * chunks
    nib = torch.cat([packed & 0x0F, packed >> 4], dim=-1).view(n4, ng, chunks, 4, 8)  # [n4, ng, G/8, 4 rows, 8 k]
    q = nib.permute(0, 3, 1, 2, 4).reshape(4 * n4, ng * group_size)[:n].double().view(n, ng, group_size)
    sm = scale_min.double()
    w = (q * sm[..., 0:1] + sm[..., 1:2]).float()
    return w.view(n, ng * group_size)[:, :in_features].contiguous()


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


def small_gemm_q4(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_q4(packed, scale_min)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_q4(x, packed, scale_min, bias)


def small_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, factor: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_bf16(packed, factor)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_bf16(x, packed, factor, bias)


KINDS = ("int4", "bf16")


@dataclass(frozen=True)
class Compact:
    """A Linear's weight as int4 or bf16 for the kernels: (packed, scale) as pack_q4 / pack_bf16 give them."""

    kind: str  # "int4" or "bf16"
    packed: torch.Tensor
    scale: torch.Tensor  # int4: fp16 [N, groups, 2] (scale, min); bf16: fp32 [N] row factors (ones)

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
