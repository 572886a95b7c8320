// AVX2 helpers shared by the CPU kernels (small_gemm.cpp, wide_gemm.cpp, decode_glue.cpp).
#pragma once
#include <immintrin.h>

// The 8 lanes of v summed in one fixed order (the kernels' batch invariance relies on it).
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes (Cephes-style: 2^n e^r with |r| <= ln2 / 2 and a degree-6 polynomial, ~2 ulp; x < -87.3 gives 0,
// so masked scores of -inf vanish). ~8x cheaper than 8 calls to std::exp, which dominated softmax and SiLU.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// e^x for n values in place (the tail through a padded copy, so every value takes the same formula).
inline void exp_inplace(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
  if (i < n) {
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) tail[j - i] = v[j];
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    for (int64_t j = i; j < n; ++j) v[j] = tail[j - i];
  }
}

// silu(g) * u = g / (1 + e^-g) * u for 8 lanes: decode_glue's silu_mul and the wide kernel's gated epilogue
// (wide_gemm_silu) both compute it here, so a prefill's fused MLP gives the same bits as the GEMM then silu_mul.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));  // e^-g (the sign flipped, as -g)
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
