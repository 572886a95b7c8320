// y = x @ w^T (+ bias) for int8 weights (symmetric, one fp32 scale per row) with the activations quantized to int8 per
// group of G inputs (act_quant.h, as q4_gemm.cpp does): the dot products run on integers (AVX-512 VNNI's dpbusd where the
// CPU has it, AVX2's maddubs + madd otherwise). The kernel it replaced widened every weight to fp32 and multiplied fp32
// activations: compute-bound at ~0.5 of the roofline (BENCHMARKS 13).
//
// Weights (cpu_gemm.pack_q8): int8 [ceil(N/16), ng, G/4, 64], q in [-127, 127]. Rows in blocks of 16 (one 32-bit lane
// each in a 512-bit register); per block and group j, line c holds inputs jG + 4c .. jG + 4c + 3: byte 4r + i is row r's
// q of input jG + 4c + i (zeros in the padding rows and inputs). scale fp32 [N]: weight = scale[n] * q.
//
// Output row m, column n:  y = scale[n] * (sum over groups j in order of fma(float(sum_k q xq), d_j, acc)) (+ bias[n]).
// The group's integer dot sum_k q xq is exact (|.| <= 32 * 127 * 127 < 2^19) and computed two ways with one result:
// - AVX-512 VNNI: dpbusd multiplies unsigned by signed bytes, so the weights enter as q + 128 (the sign bit flipped,
//   in [1, 255]) and the group's 128 * sum xq is subtracted: sum (q + 128) xq - 128 sum xq = sum q xq.
// - AVX2: maddubs adds pairs of u8 x s8 products into int16 with saturation, and (q + 128) xq pairs reach 64,770; so it
//   multiplies |q| (<= 127) by xq carrying q's sign (vpsignb): each product is q xq, a pair <= 2 * 127 * 127 = 32,258.
// Every float operation is the same on both ISAs, each lane is one output, and a row's quantization depends on that row
// only: a row's result does not depend on M, the passes or the ISA (batch-invariant: speculation stays lossless).
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

using tandem_kernels::Acts;

constexpr int64_t kBlock = 16;  // rows of w per block
constexpr int64_t kLine = 64;  // bytes per line: 16 rows x 4 inputs
constexpr int64_t kGrain = 3;  // blocks per parallel_for grain (48 rows)
constexpr int64_t kAhead = 1024;  // passes of 3+ rows of x prefetch the weight stream this far ahead into L1; at 1-2 rows
// the pass is memory-bound and the hardware prefetcher alone streams faster (q4_gemm.cpp's measurement)
template <int M>
constexpr bool kPrefetch = M > 2;
constexpr int kRowsX2 = 6;  // AVX2: rows of x per pass over a half block (6 x 2 accumulators)
constexpr int kRowsX512 = 12;  // AVX-512: 12 x 2 accumulators of 32

struct Out {
  const float* scale;  // [N]
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N]
  int64_t N;
};

// One compiled copy for both ISAs, so neither can contract the scale and the bias into an FMA.
__attribute__((noinline)) float end_output(float s, const Out& o, int64_t n) {
  s *= o.scale[n];
  return o.bias ? s + o.bias[n] : s;
}

struct Block {
  const int8_t* base;  // this block: ng groups of G/4 lines
  int64_t lines;  // G / 4
  const int8_t* group(int64_t j) const { return base + j * lines * kLine; }
};

int32_t four(const int8_t* xq) {  // 4 activations as one 32-bit lane
  int32_t v;
  std::memcpy(&v, xq, 4);
  return v;
}

// ---- AVX2: half a block (8 rows, bytes 32h .. 32h + 31 of each line) against M rows of x ------------------------
template <int M>
void pass2(const Block& w, int h, const Acts& a, const Out& o, int64_t m0, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.ng; ++j) {
    const int8_t* g = w.group(j);
    __m256i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm256_setzero_si256();
    for (int64_t c = 0; c < w.lines; ++c) {
      const int8_t* line = g + c * kLine;
      if (kPrefetch<M>) _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
      const __m256i magnitude = _mm256_abs_epi8(q);
      for (int m = 0; m < M; ++m) {
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four(a.xq(m0 + m, j) + 4 * c)), q);  // xq sign(q)
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
      }
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_set1_ps(a.d[(m0 + m) * a.ng + j]), acc[m]);
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
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M];
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.ng; ++j) {
    const int8_t* g = w.group(j);
    __m512i dot[M];
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t c = 0; c < w.lines; ++c) {
      const int8_t* line = g + c * kLine;
      if (kPrefetch<M>) _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      const __m512i offset = _mm512_xor_si512(_mm512_loadu_si512(line), flip);  // q + 128 as unsigned bytes
#pragma GCC unroll 12
      for (int m = 0; m < M; ++m) dot[m] = _mm512_dpbusd_epi32(dot[m], offset, _mm512_set1_epi32(four(a.xq(m0 + m, j) + 4 * c)));
    }
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * a.ng + j;
      const __m512i exact = _mm512_sub_epi32(dot[m], _mm512_set1_epi32(128 * a.qsum[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a.d[at]), acc[m]);
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
void row_blocks(const int8_t* wp, int64_t lines, int64_t ng, const Acts& a, const Out& o, int64_t b0, int64_t b1, int64_t M) {
  static const bool vnni = vnni_supported();
  const bool wide = vnni && tandem_kernels::use_avx512();
  const int64_t most = wide ? kRowsX512 : kRowsX2;
  const int64_t num_passes = (M + most - 1) / most;
  for (int64_t b = b0; b < b1; ++b) {
    const Block w{wp + b * ng * lines * kLine, lines};
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

// Symmetric int8 rows: scale[n] = max |w[n, :]| / 127, q = round(w / scale) in [-127, 127] (half to even). One pass per
// row in C++ (the torch-op version took ~80 ms for a 16k x 576 draft LM head, a stall at every hot-swap).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.device().is_cpu() && weight.dim() == 2, "quantize_rows: fp32 CPU [N, K] only");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor q = at::empty({N, K}, w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({N}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = wp + n * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(row[k]));
      const float step = std::max(amax / 127.f, 1e-12f);
      sp[n] = step;
      for (int64_t k = 0; k < K; ++k) qp[n * K + k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(row[k] / step))));
    }
  });
  return {q, scale};
}

}  // namespace

namespace tandem_kernels {

at::Tensor small_gemm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 4 && packed.size(3) == kLine,
              "small_gemm_q8: weights must be pack_q8's contiguous int8 [ceil(N/16), ng, G/4, 64]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1, "small_gemm_q8: scale must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, "small_gemm_q8: x must be an fp32 CPU tensor");
  const int64_t N = scale.numel(), K = x.size(-1), ng = packed.size(1), lines = packed.size(2), G = 4 * lines;
  TORCH_CHECK(lines >= 2 && (lines & (lines - 1)) == 0, "small_gemm_q8: the group size must be 8 times a power of two, got ", G);
  TORCH_CHECK(packed.size(0) == (N + kBlock - 1) / kBlock && ng == (K + G - 1) / G,
              "small_gemm_q8: weights [", packed.sizes(), "] do not fit N = ", N, ", K = ", K);
  const at::Tensor b = checked_bias(bias, N, "small_gemm_q8");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const Acts a = quantize_acts(x2.data_ptr<float>(), M, K, G);
    const Out o{scale.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N};
    const int8_t* wp = packed.data_ptr<int8_t>();
    at::parallel_for(0, packed.size(0), kGrain, [&](int64_t b0, int64_t b1) { row_blocks(wp, lines, ng, a, o, b0, b1, M); });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace tandem_kernels

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("small_gemm_q8(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("quantize_rows(Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("small_gemm_q8", &tandem_kernels::small_gemm_q8);
  m.impl("quantize_rows", &quantize_rows);
}
