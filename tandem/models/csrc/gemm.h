// The small-M GEMMs of small_gemm.cpp, for the other kernels of the extension (decode_glue.cpp's stack forward),
// and the argument checks the GEMM kernels share (small_gemm.cpp, wide_gemm.cpp).
#pragma once
#include <torch/extension.h>

namespace tandem_kernels {

// y = x @ w^T (+ bias); x [..., K] fp32, w a contiguous fp32 [N, K].
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
// The same over weight-only int8 rows with one fp32 scale each, in interleave_q8's layout (small_gemm.cpp).
at::Tensor small_gemm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias);

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

}  // namespace tandem_kernels
