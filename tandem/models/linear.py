"""The Linear layer and its inference paths: the small-M kernel on the dense weight, a oneDNN prepacked copy, or a
int8 / int4 / bf16 copy (see `Linear`), with `pack_linears` / `unpack_linears` over a module."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models import cpu_gemm, decode_glue
from tandem.models.quant_gemm import Compact


class Linear(nn.Module):
    """y = x W^T + b, with a faster inference path chosen by `pack()`.

    On this CPU a plain fp32 F.linear repacks W on every call, so a 5-token forward costs ~1.7x a
    1-token one. `pack()` picks, per weight:
    - "small": fp32 on an AVX2 CPU where tandem.models.cpu_gemm built: decode / verify-shaped inputs
      ([B, T, in] with T <= decode_glue.MAX_NEW_TOKENS, whatever B, or other shapes of <= cpu_gemm.MAX_ROWS
      rows) run the batch-invariant small-M kernel on the dense row-major weight itself (no second copy;
      ~1.4x faster than oneDNN at M = 1 here, docs/BENCHMARKS.md 1.4), prefill-shaped inputs ([B, T, in] with
      more tokens per row) the wide kernel on the same weight (faster for many rows, in its own summation
      order), other large ones F.linear;
    - "onednn": a prepacked oneDNN copy of W (5 tokens ~1.3x the cost of 1), for other dtypes / machines,
      or when asked for (`pack(gemm="onednn")`);
    - "int8": int8 rows with one scale each (cpu_gemm.pack_q8) next to the dense weight, run on integers with
      the activations quantized to int8 per group of 32 (cpu_gemm.small_gemm_q8) for every inference input
      (prefill too: the same bits as decode): a quarter of the bytes, batch-invariant, but not the fp32 weight's
      numbers (drafter modules, whose outputs need not be the target's; the int8 target, the user's choice);
    - "int4" / "bf16": group-wise int4 or bf16 weights (tandem.models.quant_gemm) next to the dense weight, run by
      their own batch-invariant kernels for every inference input (prefill too: the same bits as decode); an eighth /
      half of the bytes, another model than the fp32 one, the user's choice.
    Either is derived state: `pack()` rebuilds it after weights change, `unpack()` drops it.

    One copy of W, not two: `pack(keep_dense=False)` drops the dense Parameter once the packed copy
    exists (the oneDNN reorder is exact, so nothing is lost; an int8 / int4 / bf16 copy replaces the fp32
    weight by the quantized model's own, so a 1.5B model served in int8 holds ~2 GB, not ~9). While dropped,
    reading `.weight` or `state_dict()` returns a fresh dense copy (read-only: writes to it are lost; the
    dequantized values for int8 / int4 / bf16), `load_state_dict` repacks (also when the dense copy is kept),
    and `unpack()` restores the Parameter (bit-for-bit from oneDNN, dequantized from the others); to change
    weights in place: `unpack()`, write, `pack()`. A weight shared with another module (tied embeddings) is
    freed only when no other module holds it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # [out]
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout of weight, CPU only
        self.small_gemm = False  # inference runs tandem.models.cpu_gemm's kernel on the dense weight
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None  # cpu_gemm.pack_q8's (int8 blocks, fp32 scale [out]) for gemm="int8"
        self.compact: Compact | None = None  # int4 / bf16 weights for gemm="int4" / "bf16"
        self.batch_hint = 8
        self._weight_requires_grad = True  # restored on unpack() when the dense Parameter was dropped
        decode_glue.linears_changed()  # a new Linear (one put in place of another): cached weight stacks are stale

    @property
    def dense_dropped(self) -> bool:
        return "weight" not in self._parameters and (self.packed is not None or self.int8 is not None or self.compact is not None)

    def dense_weight(self) -> torch.Tensor:  # [out, in]
        """The weight as a plain tensor: the Parameter, or, once it was dropped, a fresh copy made from the serving
        copy (the oneDNN layout exactly; int8 / int4 / bf16 dequantized: the weights the kernels multiply by)."""
        if not self.dense_dropped:
            return self._parameters["weight"]
        if self.packed is not None:
            return self.packed.to_dense()
        if self.int8 is not None:
            return cpu_gemm.dequantize_q8(*self.int8, self.in_features)
        return self.compact.dense(self.in_features)

    def pack(self, batch_hint: int = 8, keep_dense: bool = True, gemm: str = "auto") -> None:
        """gemm "auto": the small-M kernel where it applies, else oneDNN; "onednn": oneDNN only."""
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        weight = self.dense_weight()
        decode_glue.linears_changed()
        if gemm == "int8":
            if not cpu_gemm.available():
                raise ValueError(f"gemm 'int8' needs the small-M kernel, which is not available: {cpu_gemm.unusable_reason() or 'the build failed'}")
            self.unpack()
            self.int8 = cpu_gemm.pack_q8(weight)
            self._drop_dense(keep_dense)
            return
        if gemm in ("int4", "bf16"):
            compact = Compact.of(weight, gemm)
            self.unpack()
            self.compact = compact
            self._drop_dense(keep_dense)
            return
        if gemm == "auto" and weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_gemm.available():
            self.unpack()
            param = self._parameters["weight"]
            if not param.is_contiguous():
                param.data = param.data.contiguous()
            self.small_gemm = True
            return
        self.small_gemm = False
        usable = weight.device.type == "cpu" and weight.dtype in packable_dtypes() and torch.backends.mkldnn.is_available()
        if not usable:
            self.unpack()
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.batch_hint = batch_hint
        if keep_dense and "weight" not in self._parameters:
            self._restore_weight(weight)
        elif not keep_dense and "weight" in self._parameters:
            self._weight_requires_grad = self._parameters.pop("weight").requires_grad

    def _drop_dense(self, keep_dense: bool) -> None:
        """A quantized serving copy replaces the dense weight unless keep_dense (a model served in int8 holds its
        bytes once, not the fp32 weight beside them; a module trained later keeps the dense weight)."""
        if not keep_dense and "weight" in self._parameters:
            self._weight_requires_grad = self._parameters.pop("weight").requires_grad

    def unpack(self) -> None:
        decode_glue.linears_changed()
        if self.dense_dropped:
            self._restore_weight(self.dense_weight())  # oneDNN: the weight exactly; int8 / int4 / bf16: their dequantized values
        self.packed = None
        self.small_gemm = False
        self.int8 = None
        self.compact = None

    @property
    def is_packed(self) -> bool:
        """An inference path other than plain F.linear is set up (rebuild it with pack() after weight changes)."""
        return self.small_gemm or self.packed is not None or self.int8 is not None or self.compact is not None

    def _restore_weight(self, weight: torch.Tensor) -> None:
        param = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(), requires_grad=self._weight_requires_grad)
        self._parameters["weight"] = param  # not setattr: register_parameter's hasattr() would see __getattr__'s copy

    def __getattr__(self, name: str):
        if name == "weight" and self.dense_dropped:
            return self.dense_weight()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.dense_dropped:
            destination[prefix + "weight"] = self.dense_weight()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # loading new weights repacks them
        packed, small, int8, dropped = self.packed is not None, self.small_gemm, self.int8 is not None, self.dense_dropped
        compact = None if self.compact is None else self.compact.kind
        self.unpack()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if compact is not None:
            self.pack(gemm=compact, keep_dense=not dropped)
        elif int8:
            self.pack(gemm="int8", keep_dense=not dropped)
        elif small:
            self.pack(self.batch_hint)
        elif packed:
            self.pack(self.batch_hint, keep_dense=not dropped, gemm="onednn")

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out / 2]
        """decode_glue.silu_mul(self(x)) for a fused gate/up projection (gate rows first). A prefill-shaped inference
        input on the wide kernel gets it from the GEMM's epilogue (cpu_gemm.wide_gemm_silu: the same bits, without
        writing and re-reading the [..., out] product)."""
        if self.bias is None and not torch.is_grad_enabled() and decode_glue.prefill_shaped(x) and self.small_gemm and x.dtype == torch.float32:
            return cpu_gemm.wide_gemm_silu(x, self._parameters["weight"])
        return decode_glue.silu_mul(self(x))

    def _small_input(self, x: torch.Tensor) -> bool:
        """A decode / verify step of any batch (by tokens per row, never by rows: a row gets the same bits in any
        batch), or another input of at most cpu_gemm.MAX_ROWS rows; x is not prefill-shaped."""
        return decode_glue.decode_shaped(x) or x.numel() <= cpu_gemm.MAX_ROWS * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compact is not None:
            bias = None if self.bias is None else self.bias.detach()
            if torch.is_grad_enabled():  # the served weights, differentiable in x (gradients never reach the dense weight)
                return F.linear(x.float(), self.compact.dense(self.in_features), self.bias)
            return self.compact(x, bias)
        if self.int8 is not None and not torch.is_grad_enabled():
            return cpu_gemm.small_gemm_q8(x.float(), *self.int8, None if self.bias is None else self.bias.detach())
        if self.small_gemm and not torch.is_grad_enabled() and x.dtype == torch.float32:
            bias = None if self.bias is None else self.bias.detach()
            if decode_glue.prefill_shaped(x):
                return cpu_gemm.wide_gemm(x, self._parameters["weight"], bias)
            if self._small_input(x):
                return cpu_gemm.small_gemm(x, self._parameters["weight"], bias)
        if self.packed is not None and not torch.is_grad_enabled():
            bias = None if self.bias is None else self.bias.detach()
            if torch.compiler.is_compiling():  # an opaque call: inductor lowers mkldnn linears only for frozen constants
                return torch.ops.tandem.linear_packed(x, self.packed, bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        weight = self.dense_weight()
        if cpu_gemm.wide_applies(x, weight) and (torch.is_grad_enabled() or decode_glue.prefill_shaped(x)):
            # unpacked: training runs the wide kernel and its backward by rows; inference only by tokens per sequence, as
            # above, so a decode / verify row never changes kernel with the batch
            return cpu_gemm.linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)


GEMMS = ("auto", "onednn", "int8", "int4", "bf16")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 always; bf16 where oneDNN has bf16 kernels for this CPU (AVX-512 BF16 / AMX): there a packed
    bf16 forward reads half the bytes (121 GEMMs of SmolLM2 at M = 1: 6.4 vs 13.3 ms on a Zen 5 box)."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


@torch.library.custom_op("tandem::linear_packed", mutates_args=())
def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., out]
    """x @ W^T + b with W in oneDNN's prepacked layout (what compiled graphs call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@linear_packed.register_fake
def _linear_packed_fake(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def pack_linears(module: nn.Module, batch_hint: int, keep_dense: bool = True, gemm: str = "auto") -> None:
    """Set up every Linear of `module` for CPU inference; call again after any weight change.

    keep_dense=False drops each dense copy where a oneDNN copy replaces it (half the memory; see Linear)."""
    for lin in module.modules():
        if isinstance(lin, Linear):
            lin.pack(batch_hint, keep_dense, gemm)


def unpack_linears(module: nn.Module) -> None:
    for lin in module.modules():
        if isinstance(lin, Linear):
            lin.unpack()
