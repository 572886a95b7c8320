// The small-M GEMMs of small_gemm.cpp, for the other kernels of the extension (decode_glue.cpp's stack forward),
// and the argument check the GEMM kernels share (small_gemm.cpp, wide_gemm.cpp).
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

}  // namespace tandem_kernels
