// y = x @ w^T (+ bias) for group-wise int4 weights with the activations quantized to int8 per group (llama.cpp's
// Q4_1 x Q8 numbers): the dot products run on integers (AVX-512 VNNI's dpbusd where the CPU has it, AVX2's
// maddubs + madd otherwise), so decode reads 5 bits a weight and does ~4x fewer operations than widening every
// weight to fp32 (the kernel this replaced: BENCHMARKS 13).
//
// Weights (quant_gemm.pack_q4): packed uint8 [ceil(N/16), ng, 1 + G/8, 64]. Rows in blocks of 16 (one 32-bit lane
// each in a 512-bit register); per block and quantization group j (G inputs), line 0 holds the 16 rows' scales then
// their 16 mins (fp16), and line 1 + c holds inputs 8c .. 8c + 7 of the group: byte 4r + i has row r's q of input
// 8c + i in its low nibble and of input 8c + 4 + i in its high nibble (q in [0, 15]; weight = fma(q, scale, min)).
// factor fp32 [N]: per-row factors (ones from pack_q4; they also name N).
//
// Activations (act_quant.h): each row of x, each group j: d = max |x| / 127, xq = round(x * (127 / max |x|)) (half to
// even), and the fp32 sum of the group's x. The weight is split as scale (q - 8) + center with center = fma(8, scale, min) in
// fp32 (within fp32 rounding of fma(q, scale, min)): the quantized activations meet only the centred part, whose
// terms are half the size of q's (about half llama.cpp Q4_1 x Q8_1's error), and the center meets the exact sum of x.
// Output row m, column n:
//   y = sum over groups in order of [ fma(float(sum_k (q - 8) xq), scale * d, acc) then fma(center, sum_x, acc) ]
// The integer dots are exact, each lane is one output and every float operation is the same on both ISAs, and a
// row's quantization depends on that row only: a row's result does not depend on M, the passes or the ISA
// (batch-invariant: a k-token verify computes what k single-token steps compute, speculation stays lossless).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "act_quant.h"
#include "gemm.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 16;  // rows of w per block
constexpr int64_t kLine = 64;  // bytes per line: 16 rows x 4 bytes
constexpr int64_t kGrain = 3;  // blocks per parallel_for grain (48 rows)
constexpr int64_t kAhead = 1024;  // passes of 3+ rows of x prefetch the weight stream this far ahead into L1 (those
// are compute-heavy; at 1-2 rows the pass is memory-bound and the hardware prefetcher alone streamed 19 vs 14 GB/s with
// the software prefetch, 8 x 17920 x 1536 weights, 1 thread, AVX-512; at 5 rows 9.6 vs 8.2 GB/s the other way)
template <int M>
constexpr bool kPrefetch = M > 2;
constexpr int kRowsX2 = 6;  // AVX2: rows of x per pass over a half block (6 x 2 accumulators)
constexpr int kRowsX512 = 12;  // AVX-512: 12 x 2 accumulators of 32

using tandem_kernels::Acts;

struct Out {
  const float* factor;  // [N]
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N]
  int64_t N;
};

__attribute__((noinline)) float end_output(float s, const Out& o, int64_t n) {
  s *= o.factor[n];
  return o.bias ? s + o.bias[n] : s;
}

struct Block {
  const uint8_t* base;  // this block: ng groups of (1 + G/8) lines
  int64_t chunks;  // G / 8
  const uint8_t* group(int64_t j) const { return base + j * (1 + chunks) * kLine; }
};

// ---- AVX2: half a block (8 rows, bytes 32h .. 32h + 31 of each line) against M rows of x ------------------------
template <int M>
void pass2(const Block& w, int h, const Acts& a, const Out& o, int64_t m0, int64_t n0) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.ng; ++j) {
    const uint8_t* g = w.group(j);
    __m256i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm256_setzero_si256();
    for (int64_t c = 0; c < w.chunks; ++c) {
      const uint8_t* line = g + (1 + c) * kLine;
      if (kPrefetch<M>) _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = a.xq(m0 + m, j) + 8 * c;
        int32_t x0, x1;
        std::memcpy(&x0, xq, 4);
        std::memcpy(&x1, xq + 4, 4);
        // |q x| <= 15 * 127: a pair sums to <= 3810 and two pairs to <= 7620, within int16
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)), _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16 * h)));
    const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 32 + 16 * h)));
    const __m256 center = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), scale, low);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * a.ng + j;
      const __m256i centred = _mm256_sub_epi32(dot[m], _mm256_set1_epi32(8 * a.qsum[at]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(scale, _mm256_set1_ps(a.d[at])), acc[m]);
      acc[m] = _mm256_fmadd_ps(center, _mm256_set1_ps(a.sum[at]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[m]);
    for (int r = 0; r < 8 && n0 + 8 * h + r < o.N; ++r) o.y[(m0 + m) * o.N + n0 + 8 * h + r] = end_output(lanes[r], o, n0 + 8 * h + r);
  }
}

// ---- AVX-512 VNNI: a whole block against M rows of x (the AVX2 pass's integers and float operations, 16 lanes) ----
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl"))) void pass512(const Block& w, const Acts& a, const Out& o, int64_t m0, int64_t n0) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.ng; ++j) {
    const uint8_t* g = w.group(j);
    __m512i dot[M];
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t c = 0; c < w.chunks; ++c) {
      const uint8_t* line = g + (1 + c) * kLine;
      if (kPrefetch<M>) _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(line);
      const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
#pragma GCC unroll 12
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = a.xq(m0 + m, j) + 8 * c;
        int32_t x0, x1;
        std::memcpy(&x0, xq, 4);
        std::memcpy(&x1, xq + 4, 4);
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x0));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x1));
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32)));
    const __m512 center = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), scale, low);
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * a.ng + j;
      const __m512i centred = _mm512_sub_epi32(dot[m], _mm512_set1_epi32(8 * a.qsum[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[at])), acc[m]);
      acc[m] = _mm512_fmadd_ps(center, _mm512_set1_ps(a.sum[at]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc[m]);
    for (int r = 0; r < kBlock && n0 + r < o.N; ++r) o.y[(m0 + m) * o.N + n0 + r] = end_output(lanes[r], o, n0 + r);
  }
}

using Pass2 = void (*)(const Block&, int, const Acts&, const Out&, int64_t, int64_t);
using Pass512 = void (*)(const Block&, const Acts&, const Out&, int64_t, int64_t);
constexpr Pass2 kPasses2[kRowsX2 + 1] = {nullptr, pass2<1>, pass2<2>, pass2<3>, pass2<4>, pass2<5>, pass2<6>};
constexpr Pass512 kPasses512[kRowsX512 + 1] = {nullptr, pass512<1>, pass512<2>, pass512<3>, pass512<4>, pass512<5>, pass512<6>,
                                               pass512<7>, pass512<8>, pass512<9>, pass512<10>, pass512<11>, pass512<12>};

bool vnni_supported() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"); }

// Every row of x against blocks [b0, b1), block by block in even passes (a block's lines stay in L1 while they run).
void row_blocks(const uint8_t* wp, int64_t chunks, int64_t ng, const Acts& a, const Out& o, int64_t b0, int64_t b1, int64_t M) {
  static const bool vnni = vnni_supported();
  const bool wide = vnni && tandem_kernels::use_avx512();
  const int64_t most = wide ? kRowsX512 : kRowsX2;
  const int64_t num_passes = (M + most - 1) / most;
  for (int64_t b = b0; b < b1; ++b) {
    const Block w{wp + b * ng * (1 + chunks) * kLine, chunks};
    for (int h = 0; h < (wide ? 1 : 2); ++h) {
      for (int64_t i = 0, m0 = 0; i < num_passes; ++i) {
        const int64_t rows = (M - m0) / (num_passes - i);
        if (wide) kPasses512[rows](w, a, o, m0, kBlock * b);
        else kPasses2[rows](w, h, a, o, m0, kBlock * b);
        m0 += rows;
      }
    }
  }
}

}  // namespace

namespace tandem_kernels {

at::Tensor small_gemm_q4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factor, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 4 && packed.size(3) == kLine,
              "small_gemm_q4: weights must be pack_q4's contiguous uint8 [ceil(N/16), ng, 1 + G/8, 64]");
  TORCH_CHECK(factor.scalar_type() == at::kFloat && factor.is_contiguous() && factor.dim() == 1, "small_gemm_q4: factor must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, "small_gemm_q4: x must be an fp32 CPU tensor");
  const int64_t N = factor.numel(), K = x.size(-1), ng = packed.size(1), chunks = packed.size(2) - 1, G = 8 * chunks;
  TORCH_CHECK(chunks > 0 && (chunks & (chunks - 1)) == 0, "small_gemm_q4: the group size must be 8 times a power of two, got ", G);
  TORCH_CHECK(packed.size(0) == (N + kBlock - 1) / kBlock && ng == (K + G - 1) / G,
              "small_gemm_q4: weights [", packed.sizes(), "] do not fit N = ", N, ", K = ", K);
  const at::Tensor b = checked_bias(bias, N, "small_gemm_q4");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const Acts a = tandem_kernels::quantize_acts(x2.data_ptr<float>(), M, K, G);
    const Out o{factor.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N};
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    at::parallel_for(0, packed.size(0), kGrain, [&](int64_t b0, int64_t b1) { row_blocks(wp, chunks, ng, a, o, b0, b1, M); });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace tandem_kernels

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("small_gemm_q4(Tensor x, Tensor packed, Tensor factor, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("small_gemm_q4", &tandem_kernels::small_gemm_q4); }
