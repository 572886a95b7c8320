// AVX2 helpers shared by the CPU kernels (small_gemm.cpp, decode_glue.cpp).
#pragma once
#include <immintrin.h>

// The 8 lanes of v summed in one fixed order (the kernels' batch invariance relies on it).
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 int8 values at q widened to fp32 lanes (weight-only int8 rows).
inline __m256 load8_i8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
