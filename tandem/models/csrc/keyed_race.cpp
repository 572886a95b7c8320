// The seeded draw: an exponential race on numbers that are a pure function of (row key, token id), for every token of
// a vocabulary in one pass (tandem.ops.sampling.keyed_sample has the definition and the same arithmetic in torch ops).
//
// For token x of a row with key k: h = mix64(k + (x + 1) * GAMMA) (SplitMix64's finaliser), u = (2 * (h >> 41) + 1) / 2^24
// in (0, 1), E = -log(u) (the Cephes logf polynomial, every product and sum rounded on its own: no fused multiply-add,
// so torch's elementwise ops give the same bits), and the row's token is the first argmax of p(x) / E. On the
// 2-core box numpy's SFC64 stream, torch's log and the race took ~170 us a row of 49k tokens; here ~8 lanes at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <limits>


namespace {

// A product the compiler must round before it is added to anything: an empty asm hides it, so no multiply-add is fused
// (torch's elementwise ops round each product, and `keyed_sample_reference` must give the same bits).
inline __m256 rounded(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

constexpr uint64_t GAMMA = 0x9E3779B97F4A7C15ull;
constexpr uint64_t MIX1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t MIX2 = 0x94D049BB133111EBull;

// The low 64 bits of a * b per 64-bit lane (AVX2 multiplies 32 x 32 -> 64 only).
inline __m256i mul64(__m256i a, __m256i b_lo, __m256i b_hi) {
  const __m256i lo = _mm256_mul_epu32(a, b_lo);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

inline __m256i mix64(__m256i z) {
  const __m256i m1_lo = _mm256_set1_epi64x(static_cast<int64_t>(MIX1 & 0xFFFFFFFFull)), m1_hi = _mm256_set1_epi64x(static_cast<int64_t>(MIX1 >> 32));
  const __m256i m2_lo = _mm256_set1_epi64x(static_cast<int64_t>(MIX2 & 0xFFFFFFFFull)), m2_hi = _mm256_set1_epi64x(static_cast<int64_t>(MIX2 >> 32));
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1_lo, m1_hi);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2_lo, m2_hi);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// (2 * (h >> 41) + 1) for 8 tokens: two vectors of 4 hashes -> one of 8 int32 (tokens in order).
inline __m256i odd_mantissas(__m256i h0, __m256i h1) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i a = _mm256_permutevar8x32_epi32(_mm256_srli_epi64(h0, 41), even);  // low halves first
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_srli_epi64(h1, 41), even);
  const __m256i m = _mm256_permute2x128_si256(a, b, 0x20);
  return _mm256_add_epi32(_mm256_slli_epi32(m, 1), _mm256_set1_epi32(1));
}

// -log(u) for u in (0, 1), normal: Cephes logf with m in [sqrt(1/2), sqrt(2)), each product rounded before a sum.
inline __m256 neg_log8(__m256 u) {
  const __m256i bits = _mm256_castps_si256(u);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.0f)), big);
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
  const __m256 z = rounded(_mm256_mul_ps(f, f));
  const float c[9] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                      -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f};
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 9; ++i) p = _mm256_add_ps(rounded(_mm256_mul_ps(p, f)), _mm256_set1_ps(c[i]));
  __m256 y = rounded(_mm256_mul_ps(rounded(_mm256_mul_ps(f, z)), p));
  y = _mm256_add_ps(y, rounded(_mm256_mul_ps(e, _mm256_set1_ps(-2.12194440e-4f))));
  y = _mm256_sub_ps(y, rounded(_mm256_mul_ps(z, _mm256_set1_ps(0.5f))));
  __m256 x = _mm256_add_ps(f, y);
  x = _mm256_add_ps(x, rounded(_mm256_mul_ps(e, _mm256_set1_ps(0.693359375f))));
  return _mm256_sub_ps(_mm256_setzero_ps(), x);
}

// u(x) for 8 tokens whose (x + 1) * GAMMA are t0 (tokens 0-3) and t1 (tokens 4-7), then p / -log(u), folded into the
// lanes' running first maximum.
inline void race8(__m256i base, __m256i t0, __m256i t1, __m256 p, __m256i at, __m256& best, __m256i& best_at) {
  const __m256i h0 = mix64(_mm256_add_epi64(base, t0)), h1 = mix64(_mm256_add_epi64(base, t1));
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(odd_mantissas(h0, h1)), _mm256_set1_ps(5.9604644775390625e-8f));  // 2^-24
  // A lane whose p <= (1 - u) * best * (1 - 2^-16) cannot beat its best: -log(u) >= 1 - u (1 - u is exact here), the
  // polynomial's relative error is far below 2^-16, so p / -log(u) <= best once rounded. Most tokens of a vocabulary
  // pass no lane, and their logarithms are never taken (the first maximum is the one without this test).
  const __m256 bound = rounded(_mm256_mul_ps(rounded(_mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), u), best)), _mm256_set1_ps(0.99998474f)));
  if (_mm256_movemask_ps(_mm256_cmp_ps(p, bound, _CMP_GT_OQ)) == 0) return;
  const __m256 ratio = _mm256_div_ps(p, neg_log8(u));
  const __m256 better = _mm256_cmp_ps(ratio, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
  best = _mm256_blendv_ps(best, ratio, better);
  best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(better));
}

// One row: the first argmax over tokens of p / E. ids: each column's token id (nullptr: the column index).
int64_t race_row(const float* p, uint64_t key, const int64_t* ids, int64_t width) {
  const __m256i gamma_lo = _mm256_set1_epi64x(static_cast<int64_t>(GAMMA & 0xFFFFFFFFull)), gamma_hi = _mm256_set1_epi64x(static_cast<int64_t>(GAMMA >> 32));
  const __m256i base = _mm256_set1_epi64x(static_cast<int64_t>(key));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = _mm256_set1_ps(-1.0f);
  __m256i best_at = _mm256_setzero_si256();
  int64_t j = 0;
  if (ids == nullptr) {  // (x + 1) * GAMMA for x = j..j+7, stepped by 8 * GAMMA (products wrap, as they do one by one)
    __m256i t0 = _mm256_setr_epi64x(static_cast<int64_t>(1 * GAMMA), static_cast<int64_t>(2 * GAMMA), static_cast<int64_t>(3 * GAMMA), static_cast<int64_t>(4 * GAMMA));
    __m256i t1 = _mm256_setr_epi64x(static_cast<int64_t>(5 * GAMMA), static_cast<int64_t>(6 * GAMMA), static_cast<int64_t>(7 * GAMMA), static_cast<int64_t>(8 * GAMMA));
    const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(8 * GAMMA));
    for (; j + 8 <= width; j += 8) {
      race8(base, t0, t1, _mm256_loadu_ps(p + j), _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lane), best, best_at);
      t0 = _mm256_add_epi64(t0, step);
      t1 = _mm256_add_epi64(t1, step);
    }
  } else {
    const __m256i one = _mm256_set1_epi64x(1);
    for (; j + 8 <= width; j += 8) {
      const __m256i x0 = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + j)), one);
      const __m256i x1 = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + j + 4)), one);
      race8(base, mul64(x0, gamma_lo, gamma_hi), mul64(x1, gamma_lo, gamma_hi), _mm256_loadu_ps(p + j),
            _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lane), best, best_at);
    }
  }
  if (j < width) {  // the tail through a padded copy: a padding lane's -1 / E < 0 <= p / E ends below every real one
    int64_t token[8];
    float prob[8];
    for (int l = 0; l < 8; ++l) {
      const int64_t col = j + l < width ? j + l : width - 1;
      token[l] = (ids ? ids[col] : col) + 1;
      prob[l] = j + l < width ? p[col] : -1.0f;
    }
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(token)), x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(token + 4));
    race8(base, mul64(x0, gamma_lo, gamma_hi), mul64(x1, gamma_lo, gamma_hi), _mm256_loadu_ps(prob),
          _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lane), best, best_at);
  }
  float r[8];
  int32_t at[8];
  _mm256_storeu_ps(r, best);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), best_at);
  int64_t winner = at[0];
  float top = r[0];
  for (int l = 1; l < 8; ++l)
    if (r[l] > top || (r[l] == top && at[l] < winner)) top = r[l], winner = at[l];
  return winner;
}

}  // namespace

// probs [N, W] float32, keys [N] int64 (the rows' keys as two's complement), ids [W] int64 or none -> [N] int64 columns.
at::Tensor keyed_race(const at::Tensor& probs, const at::Tensor& keys, const std::optional<at::Tensor>& ids) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "keyed_race: probs must be [N, W] float32");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.size(0) == probs.size(0), "keyed_race: keys must be [N] int64");
  TORCH_CHECK(probs.size(1) < std::numeric_limits<int32_t>::max(), "keyed_race: too many columns");
  const at::Tensor p = probs.contiguous();
  const at::Tensor k = keys.contiguous();
  at::Tensor id;
  if (ids.has_value()) {
    id = ids->contiguous();
    TORCH_CHECK(id.dim() == 1 && id.scalar_type() == at::kLong && id.size(0) == probs.size(1), "keyed_race: ids must be [W] int64");
  }
  at::Tensor out = at::empty({probs.size(0)}, keys.options());
  const int64_t width = probs.size(1);
  const float* pp = p.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* ip = ids.has_value() ? id.data_ptr<int64_t>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, probs.size(0), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) op[n] = race_row(pp + n * width, static_cast<uint64_t>(kp[n]), ip, width);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("keyed_race(Tensor probs, Tensor keys, Tensor? ids) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("keyed_race", &keyed_race); }
