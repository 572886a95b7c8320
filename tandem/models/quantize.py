"""Weight-quantized copies of a target for self-speculation (EfficientRollout-style).

int8: symmetric weights, one scale per output row. Where tandem's CPU kernels built, every Linear of the copy
is a `Linear` packed with gemm="int8": int8 rows with the activations quantized to int8 per group of 32, run on integers
(cpu_gemm.small_gemm_q8; decode: a quarter of the fp32 weight bytes) and, as all its Linears
run the kernel, all layers in one `decode_layers` call. Elsewhere `Int8Linear`: fbgemm's dynamic-activation
int8 GEMM (int4 has no good AVX2 kernel in torch, see RESOURCES.md). The fbgemm copy was the only one until
stop 30; a drafted token cost ~0.7x a target step with it (docs/BENCHMARKS.md section 2, stop 30). The copy
shares the target's tensors (embedding, norms, the dense weights it quantizes); `resync_` refreshes it when the
target's weights change (RL steps).

int4 (`bits=4`): group-wise int4 (tandem.models.quant_gemm, groups of 32 with an fp16 scale and min) on its own kernel,
5/32 of the fp32 bytes; only where the kernels built (no fbgemm fallback: it raises a clear error elsewhere).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from tandem.models import cpu_gemm, decode_glue
from tandem.models.transformer import Transformer
from tandem.models.linear import Linear


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):  # weight [out, in]
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float()
        self.packed = _pack_int8(weight)

    def requantize_(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = _pack_int8(weight)
        if bias is not None:
            self.bias = bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in]
        flat = x.reshape(-1, self.in_features).float()
        out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:  # Linear's interface for a fused gate/up projection
        return decode_glue.silu_mul(self(x))


def _pack_int8(weight: torch.Tensor):
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    with warnings.catch_warnings():  # torch marks the quantized tensor API deprecated; fbgemm is still the fast path
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)


BITS = {8: "int8", 4: "int4"}  # quantized_copy's bits -> Linear.pack's gemm


def quantized_copy(target: Transformer, bits: int = 8) -> Transformer:
    """A Transformer whose Linear layers are int8 (the kernel's rows, else fbgemm) or int4 (bits=4: group-wise, the
    kernel only); everything else is shared with the target. The copy quantizes the target's dense weights, so an int4
    copy of an int8-served target is the int4 model of the same fp32 weights."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {sorted(BITS)}, got {bits!r}")
    if bits == 4 and not cpu_gemm.available():
        raise ValueError(f"an int4 copy needs the CPU kernels, which are not available: {cpu_gemm.unusable_reason() or 'the build failed'}")
    with torch.device("meta"):
        copy = Transformer(target.cfg)
    copy.load_state_dict(target.state_dict(), assign=True)
    copy.inv_freq = target.inv_freq
    copy.eval().requires_grad_(False)
    if cpu_gemm.available():
        copy.pack(gemm=BITS[bits])
        return copy
    for name, module in list(copy.named_modules()):
        if isinstance(module, Linear):
            parent_name, _, attr = name.rpartition(".")
            setattr(copy.get_submodule(parent_name) if parent_name else copy, attr, Int8Linear(module.weight, module.bias))
    return copy


def resync_(copy: Transformer, target: Transformer) -> None:
    """The target's weights changed, in place or replaced: point the copy at the target's current tensors and
    re-quantize every Linear from them, once (a kernel Linear re-quantizes as its new weight loads)."""
    target_state = target.state_dict()
    copy.load_state_dict({name: target_state[name] for name in copy.state_dict()}, assign=True)
    copy.requires_grad_(False)
    target_linears = {n: m for n, m in target.named_modules() if isinstance(m, Linear)}
    for name, module in copy.named_modules():
        if isinstance(module, Int8Linear):
            src = target_linears[name]
            module.requantize_(src.weight, src.bias)
