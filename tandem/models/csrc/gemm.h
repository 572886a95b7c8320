// The small-M GEMMs of small_gemm.cpp, for the other kernels of the extension (decode_glue.cpp's stack forward).
#pragma once
#include <torch/extension.h>

namespace tandem_kernels {

// y = x @ w^T (+ bias); x [..., K] fp32, w a contiguous fp32 [N, K].
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
// The same over weight-only int8 rows with one fp32 scale each, in interleave_q8's layout (small_gemm.cpp).
at::Tensor small_gemm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias);

}  // namespace tandem_kernels
