// The activations of the integer GEMMs (q4_gemm.cpp, q8_gemm.cpp): each row of x, each group j of G inputs (zero-padded
// to ng * G): d = max |x| / 127, xq = round(x * (127 / max |x|)) half to even (so xq in [-127, 127], never -128), the
// fp32 sum of the group's x and the sum of its xq. A row's numbers depend on that row only (batch invariance).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace tandem_kernels {

// A group whose largest |x| is below this quantizes to zeros (127 / max would overflow to inf near 1e-37, and inf * 0 is
// NaN); its terms are below 1e-30 times the weights (quant_gemm.TINY_GROUP).
constexpr float kTinyGroup = 1e-30f;

struct Acts {
  std::vector<int8_t> q;  // [M, ng * G]
  std::vector<float> d;  // [M, ng]: the step (max |x| / 127)
  std::vector<float> sum;  // [M, ng]: the group's fp32 sum of x (8 lanes over k, then lane_sum)
  std::vector<int32_t> qsum;  // [M, ng]: the group's sum of xq (a weight offset c costs c * qsum in the dot)
  int64_t ng, G;

  const int8_t* xq(int64_t m, int64_t j) const { return q.data() + (m * ng + j) * G; }
};

inline void quantize_row(const float* x, int64_t K, int64_t G, int64_t ng, int8_t* q, float* d, float* sum, int32_t* qsum) {
  std::vector<float> buf(G);
  for (int64_t j = 0; j < ng; ++j) {
    const int64_t k0 = j * G, n = std::min(G, K - k0);
    std::fill(buf.begin(), buf.end(), 0.0f);
    std::memcpy(buf.data(), x + k0, n * sizeof(float));
    __m256 amax = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t k = 0; k < G; k += 8) {
      const __m256 v = _mm256_loadu_ps(buf.data() + k);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
      acc = _mm256_add_ps(acc, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    const float top = *std::max_element(lanes, lanes + 8);  // the max is exact in any order
    d[j] = top / 127.0f;
    sum[j] = lane_sum(acc);
    const __m256 inv = _mm256_set1_ps(top >= kTinyGroup ? 127.0f / top : 0.0f);  // a tinier group quantizes to 0
    for (int64_t k = 0; k < G; k += 8) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(buf.data() + k), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i32 = _mm256_cvtps_epi32(r);  // |r| <= 127: exact
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + j * G + k), _mm_packs_epi16(i16, i16));
    }
    int32_t total = 0;
    for (int64_t k = 0; k < G; ++k) total += q[j * G + k];
    qsum[j] = total;
  }
}

// x [M, K] quantized per row and group of G inputs (G a multiple of 8).
inline Acts quantize_acts(const float* x, int64_t M, int64_t K, int64_t G) {
  Acts a;
  a.G = G;
  a.ng = (K + G - 1) / G;
  a.q.resize(M * a.ng * G);
  a.d.resize(M * a.ng);
  a.sum.resize(M * a.ng);
  a.qsum.resize(M * a.ng);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, G, a.ng, a.q.data() + m * a.ng * G, a.d.data() + m * a.ng, a.sum.data() + m * a.ng, a.qsum.data() + m * a.ng);
  });
  return a;
}

}  // namespace tandem_kernels
