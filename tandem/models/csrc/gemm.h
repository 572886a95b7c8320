// The small-M GEMMs (small_gemm.cpp, q8_gemm.cpp, q4_gemm.cpp, bf16_gemm.cpp), for the other kernels of the extension (decode_glue.cpp's stack forward),
// and the argument checks the GEMM kernels share (small_gemm.cpp, wide_gemm.cpp).
#pragma once
#include <torch/extension.h>

#include <cpuid.h>

#include <cstdlib>
#include <string>

namespace tandem_kernels {

// y = x @ w^T (+ bias); x [..., K] fp32, w a contiguous fp32 [N, K].
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
// The same over int8 rows with one fp32 scale each and int8 activations, in pack_q8's layout (q8_gemm.cpp).
at::Tensor small_gemm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias);
// The same over group-wise int4 weights and over bf16 weights, in pack_q4's / pack_bf16's layouts (quant_gemm.cpp).
at::Tensor small_gemm_q4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias);
at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factor, const c10::optional<at::Tensor>& bias);

// An optional bias as a contiguous fp32 [N] tensor (undefined when absent); `op` names the kernel in the error.
inline at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  at::Tensor b = bias->contiguous();
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, op, ": bias must be fp32 [N]");
  return b;
}

// Whether the GEMM kernels run their AVX-512 blocks: where the CPU has AVX-512 (F and DQ), unless TANDEM_CPU_ISA=avx2 or
// set_isa("avx2") says otherwise. The AVX-512 blocks do the same fused multiply-adds in the same order as the AVX2 ones
// (same bits), so this is a speed switch only (A/B runs, tests). One flag per process (an inline function's static).
inline bool avx512_supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }

inline bool& use_avx512() {
  static bool on = avx512_supported() && std::string(std::getenv("TANDEM_CPU_ISA") ? std::getenv("TANDEM_CPU_ISA") : "") != "avx2";
  return on;
}

inline std::string current_isa() { return use_avx512() ? "avx512" : "avx2"; }

// AMD family 0x19 with AVX-512 is Zen 4 (Zen 3, the same family, has no AVX-512): 512-bit operations on 256-bit units.
inline bool is_zen4() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned family = ((eax >> 8) & 0xF) + ((eax >> 8 & 0xF) == 0xF ? (eax >> 20) & 0xFF : 0);
  return family == 0x19 && avx512_supported();
}

// How far ahead (bytes) the fp32 row stream of the decode GEMM (small_gemm's stream pass) prefetches into L1; 0: not at
// all (the hardware prefetcher alone). It moves no value: a speed switch only. Defaults, measured per CPU kind: AVX2
// blocks 1 KB (Zen 3: decode 1.06-1.11x faster than none), AVX-512 blocks 4 KB (Zen 5: 1.14x faster than 1 KB), but
// none on Zen 4, where the software prefetch slowed the stream (1 thread 18 vs 24 GB/s, 2 threads 28 vs 32 GB/s; BENCHMARKS
// 8). TANDEM_CPU_PREFETCH=BYTES (or set_prefetch) overrides it for A/B runs and for CPUs not measured yet.
inline int64_t& prefetch_override() {
  static int64_t bytes = std::getenv("TANDEM_CPU_PREFETCH") ? std::atoll(std::getenv("TANDEM_CPU_PREFETCH")) : -1;
  return bytes;
}

inline int64_t stream_prefetch_bytes() {
  if (prefetch_override() >= 0) return prefetch_override();
  static const bool zen4 = is_zen4();
  return use_avx512() ? (zen4 ? 0 : 4096) : 1024;
}

// Sets the override (bytes >= 0) or clears it (-1); returns the distance in use before.
inline int64_t set_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= -1 && bytes <= (int64_t{1} << 20), "set_prefetch: bytes must be -1 (the default) or 0 .. 1 MiB, got ", bytes);
  const int64_t before = stream_prefetch_bytes();
  prefetch_override() = bytes;
  return before;
}

// "avx512" or "avx2"; returns the ISA in use before. "avx512" on a CPU without it is an error.
inline std::string set_isa(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "set_isa: isa must be avx2 or avx512, got ", isa);
  TORCH_CHECK(isa == "avx2" || avx512_supported(), "set_isa: this CPU has no AVX-512 (F + DQ)");
  const std::string before = current_isa();
  use_avx512() = isa == "avx512";
  return before;
}

}  // namespace tandem_kernels
