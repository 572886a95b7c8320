// y = x @ w^T (+ bias) for fp32 activations with few rows (decode and verify) over bf16 weights (`small_gemm_bf16`),
// widened to fp32 in registers by a 16-bit shift (exact). (Group-wise int4 runs on integers: q4_gemm.cpp.)
//
// Layout (quant_gemm.pack_bf16 builds it): rows in groups of 4, and within a group the k axis in chunks of 8, so that
// a pass over a group reads its weights as one sequential stream and feeds 4 independent FMA chains per row of x:
// packed bf16 [ceil(N/4), ceil(K/8), 4, 8] (the chunk of 4 rows x 8 k is one 64-byte line); scale fp32 [N] is a per-row
// factor (ones from pack_bf16: multiplying by 1 is exact) that also names N. The passes are templates over the weight's
// decoder (`W`: load, scales, tail), with one decoder today.
//
// Batch invariance, as in small_gemm.cpp: each weight is widened to the same fp32 value whatever the block, each
// output is summed in one order (8 lanes over k, lane_sum, the K % 8 tail in one compiled copy, then the row factor
// and the bias), so a row's result does not depend on M, the passes or the ISA: the AVX-512 passes hold two rows per
// register and do the AVX2 passes' operations lane for lane.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "simd.h"

namespace {

constexpr int64_t kRows = 4;  // rows of w per interleaved group
constexpr int64_t kGrain = 12;  // groups per parallel_for grain (48 rows, as small_gemm's tile)
constexpr int64_t kAhead = 1024;  // the weight stream is prefetched this far ahead into L1 (this layout's int8 rows decoded 1.07x faster with it; BENCHMARKS 1.7)
constexpr int kRowsX = 3;  // AVX2: rows of x per pass (3 x 4 accumulators + 4 weights of 16 registers)
constexpr int kRowsX512 = 12;  // AVX-512: 12 x 2 accumulators of 32

// ---- bf16 ------------------------------------------------------------------------------------------------------
struct Bf16 {
  const uint16_t* group;  // this group of rows: ceil(K/8) chunks of 4 x 8 bf16
  int64_t chunks;  // K / 8

  int64_t span() const { return std::max<int64_t>(chunks, 1); }  // no scales: one span

  static __m256 widen(const uint16_t* p) {  // 8 bf16 -> 8 fp32 (the upper 16 bits of each)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }

  struct Scales {};
  Scales scales(int64_t) const { return {}; }

  void load(int64_t c, const Scales&, __m256 w[kRows]) const {
    const uint16_t* chunk = group + c * 32;
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + kAhead, _MM_HINT_T0);
    for (int r = 0; r < kRows; ++r) w[r] = widen(chunk + 8 * r);
  }

  __attribute__((target("avx512f,avx512dq"))) static __m512 widen2(const uint16_t* p) {  // rows r, r + 1 (16 bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }

  using Scales512 = Scales;
  Scales512 scales512(int64_t) const { return {}; }

  __attribute__((target("avx512f,avx512dq"))) void load512(int64_t c, const Scales512&, __m512 w[2]) const {
    const uint16_t* chunk = group + c * 32;
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + kAhead, _MM_HINT_T0);
    w[0] = widen2(chunk);
    w[1] = widen2(chunk + 16);
  }

  float finish(float s, const float* x, int64_t k0, int64_t K, int r) const;
};

__attribute__((noinline)) float bf16_tail(float s, const float* x, const uint16_t* row, int64_t k0, int64_t K) {
  for (int64_t k = k0; k < K; ++k) {
    const uint32_t bits = static_cast<uint32_t>(row[k - k0]) << 16;
    float w;
    std::memcpy(&w, &bits, sizeof w);
    s += x[k] * w;
  }
  return s;
}

float Bf16::finish(float s, const float* x, int64_t k0, int64_t K, int r) const {
  return k0 < K ? bf16_tail(s, x, group + k0 / 8 * 32 + 8 * r, k0, K) : s;
}

// ---- the passes, for either weight kind -----------------------------------------------------------------------
struct Out {  // where a group's outputs go and what ends them
  const float* factor;  // per-row factor [N] or nullptr
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N]
  int64_t N;
};

__attribute__((noinline)) float end_output(float s, const Out& o, int64_t n) {
  if (o.factor) s *= o.factor[n];
  return o.bias ? s + o.bias[n] : s;
}

// M rows of x (from row m0) against one group of 4 rows of w (rows n .. n + 3), 4 accumulators per row of x; the
// scales of a quantization group are set up once for its chunks.
template <class W, int M>
void pass(const W* wd, const float* x, const Out& o, int64_t m0, int64_t n, int64_t K) {
  const int64_t full = K / 8, span = wd->span();
  __m256 acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < full; c0 += span) {
    const typename W::Scales s = wd->scales(c0 / span);
    const int64_t c1 = std::min(full, c0 + span);
    for (int64_t c = c0; c < c1; ++c) {
      __m256 wv[kRows];
      wd->load(c, s, wv);
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + 8 * c);
        for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows && n + r < o.N; ++r)
      o.y[(m0 + m) * o.N + n + r] = end_output(wd->finish(lane_sum(acc[m][r]), x + m * K, 8 * full, K, r), o, n + r);
}

// The AVX-512 pass: M rows of x against one group, two rows of w per register (row 2h in the low 8 lanes, 2h + 1 in the
// high 8) against the 8 values of x broadcast to both halves: each lane does the AVX2 pass's FMA for its output in the
// same k order, each half is reduced by the same lane_sum. (Passes over 2 or 4 groups at once, for more independent
// FMA chains at one row of x, were slower here: each group is its own stream; BENCHMARKS 13.)
template <class W, int M>
__attribute__((target("avx512f,avx512dq"))) void pass512(const W* wd, const float* x, const Out& o, int64_t m0, int64_t n, int64_t K) {
  const int64_t full = K / 8, span = wd->span();
  __m512 acc[M][2];
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < full; c0 += span) {
    const typename W::Scales512 s = wd->scales512(c0 / span);
    const int64_t c1 = std::min(full, c0 + span);
    for (int64_t c = c0; c < c1; ++c) {
      __m512 wv[2];
      wd->load512(c, s, wv);
#pragma GCC unroll 12
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + m * K + 8 * c));
        acc[m][0] = _mm512_fmadd_ps(wv[0], xv, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(wv[1], xv, acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < kRows && n + r < o.N; ++r) {
      const __m512 two = acc[m][r / 2];
      const float s = lane_sum(r % 2 ? _mm512_extractf32x8_ps(two, 1) : _mm512_castps512_ps256(two));
      o.y[(m0 + m) * o.N + n + r] = end_output(wd->finish(s, x + m * K, 8 * full, K, r), o, n + r);
    }
  }
}

template <class W>
using PassFn = void (*)(const W*, const float*, const Out&, int64_t, int64_t, int64_t);

template <class W>
struct Table {
  static constexpr PassFn<W> avx2[kRowsX + 1] = {nullptr, pass<W, 1>, pass<W, 2>, pass<W, 3>};
  static constexpr PassFn<W> avx512[kRowsX512 + 1] = {nullptr, pass512<W, 1>, pass512<W, 2>, pass512<W, 3>, pass512<W, 4>, pass512<W, 5>,
                                                      pass512<W, 6>, pass512<W, 7>, pass512<W, 8>, pass512<W, 9>, pass512<W, 10>,
                                                      pass512<W, 11>, pass512<W, 12>};
};

// Every row of x against groups [g0, g1) of w (make(g) gives group g's decoder), group by group in even passes of at
// most kRowsX (kRowsX512) rows: a group's weights stay in L1 while its passes run.
template <class W, class Make>
void row_groups(const Make& make, const float* x, const Out& o, int64_t g0, int64_t g1, int64_t M, int64_t K) {
  const bool avx512 = tandem_kernels::use_avx512();
  const PassFn<W>* table = avx512 ? Table<W>::avx512 : Table<W>::avx2;
  const int64_t most = avx512 ? kRowsX512 : kRowsX;
  const int64_t num_passes = (M + most - 1) / most;
  for (int64_t g = g0; g < g1; ++g) {
    const W wd = make(g);
    for (int64_t i = 0, m0 = 0; i < num_passes; ++i) {
      const int64_t rows = (M - m0) / (num_passes - i);
      table[rows](&wd, x + m0 * K, o, m0, 4 * g, K);
      m0 += rows;
    }
  }
}

at::Tensor output_for(const at::Tensor& x, int64_t M, int64_t N) { return at::empty({M, N}, x.options()); }

at::Tensor shaped(const at::Tensor& x, const at::Tensor& y, int64_t N) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

namespace tandem_kernels {

// bf16 weights: packed bf16 [ceil(N/4), ceil(K/8), 4, 8], factor fp32 [N] (pack_bf16: ones); x [..., K] fp32.
at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factor, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 4,
              "small_gemm_bf16: weights must be pack_bf16's contiguous bf16 [ceil(N/4), ceil(K/8), 4, 8]");
  TORCH_CHECK(factor.scalar_type() == at::kFloat && factor.is_contiguous() && factor.dim() == 1, "small_gemm_bf16: factor must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, "small_gemm_bf16: x must be an fp32 CPU tensor");
  const int64_t N = factor.numel(), K = x.size(-1);
  TORCH_CHECK(packed.size(0) == (N + 3) / 4 && packed.size(1) == (K + 7) / 8 && packed.size(2) == 4 && packed.size(3) == 8,
              "small_gemm_bf16: weights [", packed.sizes(), "] do not fit N = ", N, ", K = ", K);
  const at::Tensor b = checked_bias(bias, N, "small_gemm_bf16");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = output_for(x, M, N);
  const Out o{factor.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N};
  const float* xp = x2.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t group_elems = packed.size(1) * 32;
  auto make = [&](int64_t g) { return Bf16{wp + g * group_elems, K / 8}; };
  if (M > 0 && N > 0) {
    at::parallel_for(0, packed.size(0), kGrain, [&](int64_t g0, int64_t g1) { row_groups<Bf16>(make, xp, o, g0, g1, M, K); });
  }
  return shaped(x, y, N);
}

}  // namespace tandem_kernels

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("small_gemm_bf16(Tensor x, Tensor packed, Tensor factor, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("small_gemm_bf16", &tandem_kernels::small_gemm_bf16);
}
