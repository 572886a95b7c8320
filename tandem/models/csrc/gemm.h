// The small-M GEMMs of small_gemm.cpp, for the other kernels of the extension (decode_glue.cpp's stack forward),
// and the argument checks the GEMM kernels share (small_gemm.cpp, wide_gemm.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdlib>
#include <string>

namespace tandem_kernels {

// y = x @ w^T (+ bias); x [..., K] fp32, w a contiguous fp32 [N, K].
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
// The same over weight-only int8 rows with one fp32 scale each, in interleave_q8's layout (small_gemm.cpp).
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

// The int8 operands of small_gemm_q8 / wide_gemm_q8 for x [..., K]: packed in interleave_q8's layout
// [ceil(N/4), ceil(K/8), 4, 8] (int8, contiguous, CPU), scale fp32 [N]; returns N. `op` names the kernel in the error.
inline int64_t checked_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.device().is_cpu() && packed.is_contiguous(), op, ": weights must be contiguous int8 on the CPU");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1, op, ": scale must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, op, ": x must be an fp32 CPU tensor");
  const int64_t N = scale.numel(), K = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + 3) / 4 && packed.size(1) == (K + 7) / 8 && packed.size(2) == 4 && packed.size(3) == 8,
              op, ": weights must be interleave_q8's [ceil(N/4), ceil(K/8), 4, 8] for N = ", N, ", K = ", K);
  return N;
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

// "avx512" or "avx2"; returns the ISA in use before. "avx512" on a CPU without it is an error.
inline std::string set_isa(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "set_isa: isa must be avx2 or avx512, got ", isa);
  TORCH_CHECK(isa == "avx2" || avx512_supported(), "set_isa: this CPU has no AVX-512 (F + DQ)");
  const std::string before = current_isa();
  use_avx512() = isa == "avx512";
  return before;
}

}  // namespace tandem_kernels
