"""Weights in fewer bytes than fp32 for the decode / verify kernels: group-wise int4 and bf16 (csrc/quant_gemm.cpp).

- int4 (`pack_q4`): symmetric, one fp32 scale per group of `group_size` inputs of each output row (scale = max |w| / 7
  over the group, q = round(w / scale) in [-7, 7], round half to even), so every weight is within half a step
  (scale / 2) of the fp32 one. 4.5 bits a weight at groups of 64 (the nibbles, plus 32 bits per 64 of scale).
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

GROUP_SIZE = 64  # int4 inputs per scale (BENCHMARKS 13: quality and speed at 32 / 64 / 128)
Q4_MAX = 7  # symmetric: q in [-7, 7]


def _check_group_size(group_size: int) -> None:
    if not (isinstance(group_size, int) and group_size >= 8 and group_size % 8 == 0 and (group_size // 8) & (group_size // 8 - 1) == 0):
        raise ValueError(f"group_size must be 8 times a power of two (8, 16, 32, 64, 128, ...), got {group_size!r}")


def quantize_q4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, ng * G] in [-7, 7], zero-padded in K; scale fp32 [N, ng]) with weight ~ q * scale."""
    _check_group_size(group_size)
    w = weight.detach().float()
    n, k = w.shape
    ng = -(-k // group_size)
    grouped = F.pad(w, (0, ng * group_size - k)).view(n, ng, group_size)
    scale = (grouped.abs().amax(-1) / Q4_MAX).clamp(min=1e-12)
    q = torch.round(grouped / scale[..., None]).clamp(-Q4_MAX, Q4_MAX).to(torch.int8)
    return q.view(n, ng * group_size), scale.contiguous()


def pack_q4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_q4 in small_gemm_q4's layout: (uint8 [ceil(N/4), ng, G/8, 16], scale fp32 [N, ng]). In each chunk of 8
    inputs of 4 rows, byte i holds row i // 8's weight i % 8 (+ 8) in its low nibble and row 2 + i // 8's in its high one."""
    q, scale = quantize_q4(weight, group_size)
    n, padded_k = q.shape
    n4, ng = -(-n // 4), scale.shape[1]
    nib = F.pad((q.to(torch.int16) + 8).to(torch.uint8), (0, 0, 0, 4 * n4 - n), value=8)  # padding rows: q = 0
    chunks = nib.view(n4, 4, ng, group_size // 8, 8).permute(0, 2, 3, 1, 4)  # [n4, ng, G/8, 4 rows, 8 k]
    packed = chunks[..., :2, :] | (chunks[..., 2:, :] << 4)  # rows 0-1 in the low nibbles, rows 2-3 in the high ones
    return packed.reshape(n4, ng, group_size // 8, 16).contiguous(), scale


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:  # -> fp32 [N, K]
    """The fp32 weights small_gemm_q4 multiplies by: float(q) * scale, bit for bit."""
    n4, ng, chunks = packed.shape[:3]
    nib = torch.cat([packed & 0x0F, packed >> 4], dim=-1).view(n4, ng, chunks, 4, 8)  # [n4, ng, G/8, 4 rows, 8 k]
    q = nib.permute(0, 3, 1, 2, 4).reshape(4 * n4, ng * chunks * 8)[: scale.shape[0]].to(torch.int16) - 8
    group_size = 8 * chunks
    w = q.float().view(scale.shape[0], ng, group_size) * scale[..., None]
    return w.view(scale.shape[0], ng * group_size)[:, :in_features].contiguous()


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


def small_gemm_q4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_q4(packed, scale)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_q4(x, packed, scale, bias)


def small_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, factor: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_bf16(packed, factor)^T (+ bias) -> [..., N], batch-invariant."""
    return torch.ops.tandem_cpu.small_gemm_bf16(x, packed, factor, bias)


KINDS = ("int4", "bf16")


@dataclass(frozen=True)
class Compact:
    """A Linear's weight as int4 or bf16 for the kernels: (packed, scale) as pack_q4 / pack_bf16 give them."""

    kind: str  # "int4" or "bf16"
    packed: torch.Tensor
    scale: torch.Tensor  # int4: [N, groups]; bf16: [N] row factors (ones)

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
