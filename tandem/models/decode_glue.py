"""The per-layer glue of an eager decode / verify forward as fused CPU ops (csrc/decode_glue.cpp).

Between its four GEMMs an eager layer ran ~35 small torch ops (casts, views, RoPE's roll, the cache writes,
SDPA's set-up for a handful of queries); at a few microseconds of dispatch each that was ~15 ms of a 55-60 ms
SmolLM2 token here. With these a layer is nine calls: norm, qkv GEMM, `attend_cached` (per-head q/k norm,
RoPE, cache write, attention over the cached prefix and the new tokens' tree), o GEMM, add + norm, gate_up
GEMM, `silu_mul`, down GEMM, residual add. Built into the same extension as the small-M GEMM
(tandem.models.cpu_gemm), used where it is: fp32 on CPU, inference, a KV cache, at most MAX_NEW_TOKENS new
tokens per row, not inside torch.compile (the compiled forward fuses the glue itself). Prefills of more tokens
keep SDPA (blocked for long queries; attend_cached is not) with the fused norms and SiLU around it
(`applies_prefill`, Block.forward_prefill). Each output is computed from its own row in a fixed order, so a
row's logits do not depend on the other rows of a verify or a batch (batch invariance, as the GEMM's).

Where every Linear of every layer runs the kernel (fp32, int8 rows, int4 or bf16) and the batch fits it, `decode_layers`
runs all layers in one C++ call: the same ops in the same order (so the same bits as the per-layer path),
without the ~270 Python-level calls a token.
"""
from __future__ import annotations

import os
import weakref

import torch

from tandem.models import cpu_gemm

MAX_NEW_TOKENS = 32  # new tokens per row (decode 1, verify k + 1, trees up to 31 nodes); longer queries: SDPA and the
# wide kernel. At 16, a 17-token verify (a 12-node tree + a 4-token lookup branch) fell to the prefill path at 1.45x
# the cost (17: 38 -> 26 ms, 25: 43.5 -> 33 ms on the Zen 5 box; docs/BENCHMARKS.md 1.11)
ENV = "TANDEM_DECODE_GLUE"  # "off": the eager torch-op glue (A/B runs, a suspected problem)


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() != "off" and cpu_gemm.available()


def supports(cfg) -> bool:
    """Head shapes attend_cached handles: head_dim a multiple of 8 (<= 512), <= 8 query heads per kv head."""
    return cfg.head_dim % 8 == 0 and cfg.head_dim <= 512 and cfg.num_heads // cfg.num_kv_heads <= 8


def applies(x: torch.Tensor, cache, enabled_here: bool) -> bool:
    """Whether a layer over x [B, T, hidden] with this cache takes the fused path (decode / verify: T <= MAX_NEW_TOKENS)."""
    return (
        _inference_fp32(x, enabled_here)
        and cache is not None
        and x.shape[1] <= MAX_NEW_TOKENS
        and cache.k.dtype == torch.float32
        and cache.k.is_contiguous()
    )


def decode_shaped(x: torch.Tensor) -> bool:
    """x [B, T, features] with at most MAX_NEW_TOKENS tokens per row: a decode / verify step, whatever B."""
    return x.dim() == 3 and x.shape[1] <= MAX_NEW_TOKENS


def prefill_shaped(x: torch.Tensor) -> bool:
    """x [B, T, features] with more than MAX_NEW_TOKENS tokens per row: a prefill, never a decode / verify step
    (what picks the wide GEMM kernel and the prefill glue: by tokens per sequence, never by rows)."""
    return x.dim() == 3 and x.shape[1] > MAX_NEW_TOKENS


def applies_prefill(x: torch.Tensor, enabled_here: bool) -> bool:
    """Whether a layer over x [B, T, hidden] runs the fused norms and SiLU around SDPA (Block.forward_prefill):
    a prefill-shaped input, with or without a cache."""
    return _inference_fp32(x, enabled_here) and prefill_shaped(x)


def _inference_fp32(x: torch.Tensor, enabled_here: bool) -> bool:
    return (
        enabled_here
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


LAYER_WEIGHTS = 13  # entries per layer in decode_layers' list (csrc/decode_glue.cpp's LayerWeight order)


_linear_changes = 0  # bumped by every Linear.pack / unpack (tandem.models.transformer): cached stacks are stale
_stacks: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list | None]]" = weakref.WeakKeyDictionary()


def linears_changed() -> None:
    """A Linear's serving tensors were rebuilt or dropped: stack_weights walks the layers again."""
    global _linear_changes
    _linear_changes += 1


def stack_weights(blocks, rows: int) -> list[torch.Tensor | None] | None:
    """Every layer's weights as decode_layers takes them, or None where it does not apply: more than
    cpu_gemm.MAX_ROWS rows, or a Linear that is not on the kernel path (unpacked, oneDNN, replaced, or biased
    where the stack expects none). Cached per `blocks` until a Linear is packed or unpacked again (the walk over
    30 layers took ~1.4 ms, 3 % of a decode step); weights written in place are the same tensors."""
    if rows > cpu_gemm.MAX_ROWS:
        return None
    cached = _stacks.get(blocks)
    if cached is None or cached[0] != _linear_changes:
        cached = _stacks[blocks] = (_linear_changes, _walk_layers(blocks))
    return cached[1]


def _walk_layers(blocks) -> list[torch.Tensor | None] | None:
    out: list[torch.Tensor | None] = []
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        gemms = [_kernel_weights(lin) for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
        if any(g is None for g in gemms) or any(lin.bias is not None for lin in (attn.o, mlp.gate_up, mlp.down)):
            return None
        (qkv, qkv_scale), (o, o_scale), (gate_up, gate_up_scale), (down, down_scale) = gemms
        qkv_bias = None if attn.qkv.bias is None else attn.qkv.bias.detach()
        q_norm, k_norm = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.q_norm is not None else (None, None)
        out += [block.attn_norm.weight.detach(), qkv, qkv_scale, qkv_bias, q_norm, k_norm, o, o_scale,
                block.mlp_norm.weight.detach(), gate_up, gate_up_scale, down, down_scale]
    return out


def _kernel_weights(lin) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # (weight, int8 / int4 scale, bf16 factor or None)
    if getattr(lin, "compact", None) is not None:
        return lin.compact.packed, lin.compact.scale
    if getattr(lin, "int8", None) is not None:
        return lin.int8
    if getattr(lin, "small_gemm", False):
        return lin._parameters["weight"].detach(), None
    return None


def decode_layers(
    weights: list[torch.Tensor | None],  # stack_weights()
    x: torch.Tensor,  # [B, T, hidden] embeddings
    cos: torch.Tensor,  # [B, T, 1, D]
    sin_signed: torch.Tensor,
    eps: float,
    cache,  # KVCache
    batch,  # AttentionBatch
    num_heads: int,
    num_kv_heads: int,
    taps: tuple[int, ...],
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # the last layer's output [B, T, hidden], one per tap
    return torch.ops.tandem_cpu.decode_layers(
        x.contiguous(), weights, cos.contiguous(), sin_signed.contiguous(), eps, cache.k, cache.v, batch.rows.start or 0,
        batch.starts, batch.tree, num_heads, num_kv_heads, list(taps), batch.lengths,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.tandem_cpu.rms_norm(x.contiguous(), weight.detach(), eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x))."""
    return torch.ops.tandem_cpu.add_rms_norm(x.contiguous(), residual.contiguous(), weight.detach(), eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    return torch.ops.tandem_cpu.silu_mul(gate_up.contiguous())


def attend_cached(
    qkv: torch.Tensor,  # [B, T, (H + 2 Hkv) D]
    cos: torch.Tensor,  # [B, T, 1, D]
    sin_signed: torch.Tensor,  # [B, T, 1, D]
    q_norm: torch.Tensor | None,  # [D]
    k_norm: torch.Tensor | None,  # [D]
    eps: float,
    cache_k: torch.Tensor,  # [L, Bmax, Hkv, S, D], written at the new tokens' slots
    cache_v: torch.Tensor,
    layer: int,
    row0: int,
    starts: torch.Tensor,  # [B] cached tokens per row before this forward
    tree: torch.Tensor | None,  # [B, T, T] bool; None: causal among the new tokens
    num_heads: int,
    num_kv_heads: int,
    lengths: torch.Tensor | None = None,  # [B] new tokens per row: ragged (qkv [N, 1, F], tree [N, longest row])
) -> torch.Tensor:  # [B, T, H D] (ragged: [N, 1, H D])
    return torch.ops.tandem_cpu.attend_cached(
        qkv.contiguous(), cos.contiguous(), sin_signed.contiguous(),
        None if q_norm is None else q_norm.detach(), None if k_norm is None else k_norm.detach(), eps,
        cache_k, cache_v, layer, row0, starts, tree, num_heads, num_kv_heads, lengths,
    )
