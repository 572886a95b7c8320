"""The batch-invariant small-M GEMMs (csrc/small_gemm.cpp), compiled on first use and cached.

Decode and verify multiply a few rows of activations by every weight: on this 2-core AVX2 machine oneDNN's
prepacked GEMM streamed those weights at ~60 % of the memory bandwidth, the kernel at ~90 % (docs/BENCHMARKS.md
1.4). It reads the plain row-major weight, so a model keeps one copy of each weight (a tied LM head shares
the embedding's), and each output row is summed in an order that does not depend on the other rows, so a
k-token verify computes exactly what k single-token steps would. `small_gemm_q8` (csrc/q8_gemm.cpp) serves int8 rows
(one fp32 scale per row) on integers: each row of activations is quantized to int8 per group of 32, as the int4
kernel does (tandem.models.quant_gemm), and the dots run on VNNI (AVX2: maddubs + madd), the same integers on both: a
quarter of the fp32 bytes, the same invariance (`pack_q8`, blocks of 16 rows).
`wide_gemm` (csrc/wide_gemm.cpp) serves inputs of many tokens per sequence (prefill) from the same weight: packed
panels and an outer-product register block, compute-bound rather than bandwidth-bound, invariant in the number of
rows too, but in its own summation order (Linear uses it for fp32 prefill, never for decode or verify, and with its
backward for unpacked forwards of many rows: the GRPO learner, the head trainers; `linear`). Where the
CPU has AVX-512 the wide kernel and small_gemm's many-row blocks run on 512-bit registers (the same fused
multiply-adds in the same order, so the same bits as the AVX2 blocks; `set_isa`).

Built with torch.utils.cpp_extension into $TANDEM_HOME/build (about 30 s once; `make setup` does it). Where it
cannot be used (no C++ compiler, no AVX2, not x86-64, or TANDEM_CPU_GEMM=onednn) `available()` is False and
Linear keeps the oneDNN path; a failed build warns once.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "small_gemm.cpp", CSRC / "wide_gemm.cpp", CSRC / "q8_gemm.cpp", CSRC / "q4_gemm.cpp", CSRC / "bf16_gemm.cpp", CSRC / "decode_glue.cpp",
           CSRC / "keyed_race.cpp")  # one extension: the GEMMs
# (q8_gemm.cpp / q4_gemm.cpp: int8 / int4 weights with int8 activations; bf16_gemm.cpp: bf16 weights; tandem.models.quant_gemm), the per-layer glue (decode_glue.py)
# and the seeded draw (keyed_race.cpp: tandem.ops.sampling.keyed_sample)
HEADERS = (CSRC / "simd.h", CSRC / "gemm.h", CSRC / "act_quant.h")
ENV = "TANDEM_CPU_GEMM"  # "onednn": never use the kernel (A/B runs, a suspected kernel problem)
MAX_ROWS = 512  # measured here up to 512 rows: the register-blocked path beats F.linear (MKL) 1.1-1.5x from 64 rows on
# (BENCHMARKS 1.5); larger inputs (long prefills) go to F.linear, whose cache blocking should win there and on other CPUs
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # F16C: every AVX2 CPU has it (int4 groups' fp16 scales)

_loaded: bool | None = None


def available() -> bool:
    """True once the kernel is built and registered as torch.ops.tandem_cpu.small_gemm (cached per process)."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def unusable_reason() -> str | None:
    """Why the kernel cannot run here, or None (checked before any build)."""
    if os.environ.get(ENV, "").strip().lower() == "onednn":
        return f"{ENV}=onednn"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler"
    return None


def kernel_key() -> str:
    """The kernels' identity: their source text, the torch version and the flags (what a calibration is valid for)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + torch.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()[:12]


def build_directory() -> Path:
    """One directory per kernel key and checkout: a change rebuilds, nothing stale is loaded, and two checkouts never
    rebuild each other's copy (the build files name the sources' paths, so sharing one directory rebuilds at each switch)."""
    from tandem.models.zoo import tandem_home

    where = hashlib.sha256(str(SOURCES[0].resolve().parent).encode()).hexdigest()[:6]
    return tandem_home() / "build" / f"small_gemm-{kernel_key()}-{where}"


def _load() -> bool:
    if unusable_reason() is not None:
        return False
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        load("tandem_small_gemm", [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as error:  # a broken toolchain must not stop inference: oneDNN still works
        warnings.warn(f"tandem: the small-M GEMM kernel did not build ({type(error).__name__}: {str(error)[-300:]}); "
                      "using oneDNN's prepacked GEMM instead (slower decoding)", stacklevel=2)
        return False
    torch.library.register_fake("tandem_cpu::small_gemm")(_small_gemm_fake)
    torch.library.register_fake("tandem_cpu::small_gemm_q8")(_small_gemm_q8_fake)
    torch.library.register_fake("tandem_cpu::small_gemm_q4")(_small_gemm_q4_fake)
    torch.library.register_fake("tandem_cpu::small_gemm_bf16")(_small_gemm_q8_fake)
    torch.library.register_fake("tandem_cpu::wide_gemm")(_small_gemm_fake)
    torch.library.register_fake("tandem_cpu::wide_gemm_kn")(_wide_gemm_kn_fake)
    torch.library.register_fake("tandem_cpu::wide_gemm_silu")(_wide_gemm_silu_fake)
    torch.library.register_fake("tandem_cpu::prefill_attention")(_prefill_attention_fake)
    torch.library.register_fake("tandem_cpu::keyed_race")(lambda probs, keys, ids: keys.new_empty(probs.shape[:1]))
    return True


def _small_gemm_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _wide_gemm_kn_fake(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], b.shape[1]))


def _wide_gemm_silu_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0] // 2))


def _prefill_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def _small_gemm_q4_fake(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def _small_gemm_q8_fake(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # x [..., K], weight [N, K] -> [..., N]
    return torch.ops.tandem_cpu.small_gemm(x, weight, bias)


def wide_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # x [..., K], weight [N, K] -> [..., N]
    """The same product for prefill-sized inputs: faster from ~17 rows on, invariant in the rows, not small_gemm's bits."""
    return torch.ops.tandem_cpu.wide_gemm(x, weight, bias)


WIDE_MIN_ROWS = 33  # an unpacked linear over more rows than a verify step runs the wide kernel (and its backward)


class _WideLinear(torch.autograd.Function):
    """y = x W^T + b on the wide kernel, differentiable: dX = dY W and dW = dY^T X run on the same kernel. About 2x oneDNN / MKL's fp32 GEMMs on this box in every
    direction (docs/BENCHMARKS.md 7.3); a different summation order, so gradients agree with F.linear's within fp32
    rounding, not bit for bit. Only dY is copied (transposed, for dW); W and X are read as they lie (wide_gemm_kn)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return wide_gemm(x, weight.contiguous(), None if bias is None else bias.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1]).contiguous()  # [M, N]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = wide_gemm_kn(dy, weight.contiguous()).view(x.shape)  # [M, N] @ [N, K]
        if ctx.needs_input_grad[1]:
            dw = wide_gemm_kn(dy.t().contiguous(), x.reshape(-1, x.shape[-1]).contiguous())  # [N, M] @ [M, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


def wide_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a plain (unpacked) fp32 CPU linear over x runs `linear` here: more rows than a verify step, the kernel built."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
            and x.numel() >= WIDE_MIN_ROWS * x.shape[-1] and not torch.compiler.is_compiling() and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # x [..., K], weight [N, K] -> [..., N]
    """F.linear on the wide kernel, with its gradients (training: the GRPO learner, the head trainers; unpacked forwards)."""
    return _WideLinear.apply(x, weight, bias)


def product_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x [..., K], weight [N, K] -> x @ weight.T [..., N]
    """x @ weight.T for a frozen weight (the target's LM-head rows a head trainer scores against): the wide kernel where it
    applies, ~2x the oneDNN / MKL product the `@` runs at a few hundred rows (a flywheel step's [444, 576] x [576, 16k]:
    90 -> ~48 ms); `@` otherwise, and wherever a gradient would flow (the kernel has no backward)."""
    if wide_applies(x, weight) and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return wide_gemm(x.contiguous(), weight.contiguous())
    return x @ weight.T


def wide_gemm_kn(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # x [..., K], b [K, N] -> x @ b [..., N]
    """wide_gemm(x, b.T) without the transposed copy: the same bits (a linear's backward reads W and X as they lie)."""
    return torch.ops.tandem_cpu.wide_gemm_kn(x, b)


def wide_gemm_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x [..., K], weight [2I, K] (gate rows, then up) -> [..., I]
    """silu(x @ gate^T) * (x @ up^T): decode_glue.silu_mul(wide_gemm(x, weight)) bit for bit, in the GEMM's epilogue (a
    prefill's MLP without its [..., 2I] intermediate)."""
    return torch.ops.tandem_cpu.wide_gemm_silu(x, weight)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # q [n, H, D], k, v [Hkv, n, D] -> [n, H D]
    """Causal attention of one fresh prompt on the wide kernel's blocks (GQA: query head h reads kv head h // (H / Hkv));
    SDPA's result within fp32 rounding, and the same bits for a prompt alone or packed with others."""
    return torch.ops.tandem_cpu.prefill_attention(q, k, v, scale)


def set_isa(isa: str) -> str:
    """Run the kernels' AVX-512 blocks ("avx512", the default where the CPU has AVX-512 F + DQ) or their AVX2 blocks
    ("avx2"; also TANDEM_CPU_ISA=avx2); returns the one in use before. Both give the same bits (A/B runs, tests)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unusable_reason() or 'the build failed'}")
    return torch.ops.tandem_cpu.set_isa(isa)


def set_prefetch(bytes_ahead: int) -> int:
    """How far ahead the fp32 decode stream prefetches (bytes; 0: none, -1: this CPU kind's default, also
    TANDEM_CPU_PREFETCH); returns the distance in use before. A speed switch only: it moves no value."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unusable_reason() or 'the build failed'}")
    return torch.ops.tandem_cpu.set_prefetch(bytes_ahead)


def isa() -> str:
    """The kernels' blocks in use: "avx512" or "avx2"."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unusable_reason() or 'the build failed'}")
    return torch.ops.tandem_cpu.current_isa()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] -> int8 [N, K], fp32 scale [N]
    """Symmetric int8 rows, one scale per output row: weight ~ scale[:, None] * q (round half to even)."""
    return torch.ops.tandem_cpu.quantize_rows(weight.detach())


def quantize_rows_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # what the C++ op computes
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


GROUP_SIZE = 32  # activations per int8 scale (quant_gemm.GROUP_SIZE: the same groups as int4's)
BLOCK = 16  # rows of w per block of small_gemm_q8's layout (one 32-bit lane each in a 512-bit register)
LINE = 64  # bytes per line: 16 rows x 4 inputs


def pack_q8(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] -> (int8 [ceil(N/16), ng, G/4, 64], scale [N])
    """quantize_rows in small_gemm_q8's layout: per block of 16 rows and group of G inputs, line c holds inputs
    4c .. 4c + 3 of the group, byte 4r + i row r's q of input 4c + i (zeros in the padding)."""
    if not (isinstance(group_size, int) and group_size >= 8 and group_size % 8 == 0 and (group_size // 8) & (group_size // 8 - 1) == 0):
        raise ValueError(f"group_size must be 8 times a power of two (8, 16, 32, 64, 128, ...), got {group_size!r}")
    q, scale = quantize_rows(weight)
    n, k = q.shape
    nb, ng = -(-n // BLOCK), -(-k // group_size)
    padded = torch.nn.functional.pad(q, (0, ng * group_size - k, 0, nb * BLOCK - n))
    lines = padded.view(nb, BLOCK, ng, group_size // 4, 4).permute(0, 2, 3, 1, 4)  # [nb, ng, lines, 16 rows, 4 inputs]
    return lines.reshape(nb, ng, group_size // 4, LINE).contiguous(), scale


def unpack_q8(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:  # -> int8 [N, K] row-major
    nb, ng, lines = packed.shape[:3]
    rows = packed.view(nb, ng, lines, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(nb * BLOCK, ng * lines * 4)
    return rows[: scale.numel(), :in_features]


def dequantize_q8(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:  # -> fp32 [N, K]
    return unpack_q8(packed, scale, in_features).float() * scale[:, None]


def small_gemm_q8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # x [..., K] -> [..., N]
    """x @ (scale * q)^T (+ bias) with (packed, scale) = pack_q8(w), x quantized to int8 per group (batch-invariant)."""
    return torch.ops.tandem_cpu.small_gemm_q8(x, packed, scale, bias)


def describe() -> str:
    """One line for set-up logs and benchmark reports (builds the kernel if it is not built yet)."""
    if available():
        return f"small-M GEMM kernel: built ({build_directory()})"
    return f"small-M GEMM kernel: not used ({unusable_reason() or 'the build failed'}): oneDNN prepacked GEMMs"
