// y = x @ w^T (+ bias) for fp32 activations with few rows (decode and verify), w a plain row-major [N, K].
//
// Why: on the 2-core AVX2 box oneDNN's prepacked GEMM streams a decode step's weights at ~60 % of the memory
// bandwidth; this kernel reads each weight once per call at close to it (docs/BENCHMARKS.md 1.4), and it
// works on the row-major weight, so the model keeps one copy of every weight.
//
// Batch invariance: every output y[m, n] is summed in the same order whatever M, the row grouping or the
// thread split (8 lanes over k in steps of 8, a fixed lane reduction, the K % 8 tail, then the bias). A row
// computed inside a k-token verify is bit-identical to the same row computed alone, so speculative and plain
// decoding of an fp32 target see the same logits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "gemm.h"
#include "simd.h"

namespace {

constexpr int64_t kTile = 48;  // w rows per tile: 48 x K floats stay in L2 while every row of x passes over them
constexpr int kStreamRows = 12;  // few rows (M <= kStreamMaxM): up to 12 rows of x per pass against one w row at a time
constexpr int64_t kStreamMaxM = 16;
constexpr int kBlockX = 4;  // more rows: register blocks of 4 rows of x x 3 rows of w (12 accumulators + 3 w + 1 x
constexpr int kBlockW = 3;  // of 16 ymm registers), ~1.1-1.25x faster from M = 32 on, ~0.9x below (BENCHMARKS 1.5)
constexpr int64_t kPrefetchBytes = 1024;  // the weight stream is prefetched this far ahead into L1: a decode step
// 1.06-1.11x (fp32) and 1.07x (int8) faster here (BENCHMARKS 1.7); it moves no value, so no result changes
// The fp32 stream pass's distance depends on the CPU kind: gemm.h's stream_prefetch_bytes (Zen 5 box: 4 KB made decoding
// 1.14x faster than 1 KB, 2 KB 1.05x, 8 KB no better, BENCHMARKS 1.9; Zen 4: none, BENCHMARKS 8).

// s + the K % 8 tail of one output's dot product (k0 .. K - 1), in one compiled copy for every block and pass, so the
// AVX-512 blocks (compiled for another target) cannot round it differently (e.g. by contracting into FMAs).
__attribute__((noinline)) float tail_dot(const float* x, const float* w, float s, int64_t k0, int64_t K) {
  for (int64_t k = k0; k < K; ++k) s += x[k] * w[k];
  return s;
}

// One register block: y[m, n] = sum_k x[m, k] w[n, k] + bias[n] for the M rows of x at x and the
// NW rows of w from n. Each output has its own accumulator, fed in the same k order whatever M and NW (the
// blocking only decides how many of them run side by side), so its result does not depend on the blocking,
// the pass or the tile it falls in: stream_pass below gives the same bits.
template <int M, int NW>
void block(const float* x, const float* w, const float* bias, float* y, int64_t n, int64_t K, int64_t N) {
  __m256 acc[M][NW];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NW; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm256_loadu_ps(w + (n + j) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NW; ++j) acc[m][j] = _mm256_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < NW; ++j) {
      const float* wr = w + (n + j) * K;
      float s = lane_sum(acc[m][j]);
      if (k < K) s = tail_dot(x + m * K, wr, s, k, K);
      y[m * N + n + j] = bias ? s + bias[n + j] : s;
    }
  }
}

// Rows [n0, n1) of w against the M rows of x at x, one w row at a time (what decode and short verifies run:
// a single stream through w, at the memory bandwidth).
template <int M>
void stream_pass(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t ahead = tandem_kernels::stream_prefetch_bytes();
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(wr + k) + ahead, _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = lane_sum(acc[m]);
      if (k < K) s = tail_dot(x + m * K, wr, s, k, K);
      y[m * N + n] = bias ? s + bias[n] : s;
    }
  }
}

// The same in register blocks of kBlockW rows of w (the last ones one by one): fewer loads per FMA once M is large.
template <int M>
void blocked_pass(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  int64_t n = n0;
  for (; n + kBlockW <= n1; n += kBlockW) block<M, kBlockW>(x, w, bias, y, n, K, N);
  for (; n < n1; ++n) block<M, 1>(x, w, bias, y, n, K, N);
}

// The AVX-512 register block (CPUs that have it): two rows of w per zmm (row n in the low 8 lanes, row n + 1 in the
// high 8) against the same 8 values of x broadcast to both halves, so every lane does exactly the FMA the AVX2 block
// does for its output, in the same k order, and each half is reduced by the same lane_sum: the AVX2 block's bits,
// with twice the work per instruction and 32 registers (8 rows of x x 6 rows of w: 24 accumulators). While a block
// runs it prefetches the next block's rows into L2 (the hardware prefetcher does not follow six row streams): a
// model's worth of [M, K] x [K, N] calls ran 1.20x / 1.17x / 1.10x / 1.04x faster at M = 12 / 24 / 47 / 60 (BENCHMARKS 1.10).
constexpr int kBlockX512 = 8;
constexpr int64_t kStreamMaxM512 = 2;  // with AVX-512 the blocks take over above this many rows of x: a model's worth of
// calls at M = 3-8 ran 1.4-1.8x faster on the blocks (six rows of w in flight, the next six prefetched) than on the
// stream, M = 1-2 no faster (BENCHMARKS 1.14); the same bits either way
constexpr int kBlockW512 = 6;

template <int M, int NW>
__attribute__((target("avx512f,avx512dq"))) void block512(const float* x, const float* w, const float* bias, float* y, int64_t n, int64_t K, int64_t N) {
  static_assert(NW % 2 == 0, "two rows of w per register");
  constexpr int NZ = NW / 2;
  __m512 acc[M][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_setzero_ps();
  const bool prefetch = n + 2 * NW <= N;  // the next block's rows exist
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (prefetch && k % 16 == 0) {  // one cache line of each of the next block's rows of w: they are on their way from DRAM
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (n + NW + j) * K + k), _MM_HINT_T1);
    }
    __m512 wv[NZ];
#pragma GCC unroll 4
    for (int j = 0; j < NZ; ++j)
      wv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + (n + 2 * j) * K + k)), _mm256_loadu_ps(w + (n + 2 * j + 1) * K + k), 1);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + m * K + k));
#pragma GCC unroll 4
      for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < NW; ++j) {
      const __m512 pair = acc[m][j / 2];
      const float* wr = w + (n + j) * K;
      float s = lane_sum(j % 2 ? _mm512_extractf32x8_ps(pair, 1) : _mm512_castps512_ps256(pair));
      if (k < K) s = tail_dot(x + m * K, wr, s, k, K);
      y[m * N + n + j] = bias ? s + bias[n + j] : s;
    }
  }
}

template <int M>
__attribute__((target("avx512f,avx512dq"))) void blocked_pass512(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  int64_t n = n0;
  for (; n + kBlockW512 <= n1; n += kBlockW512) block512<M, kBlockW512>(x, w, bias, y, n, K, N);
  for (; n + 2 <= n1; n += 2) block512<M, 2>(x, w, bias, y, n, K, N);
  if (n < n1) block<M, 1>(x, w, bias, y, n, K, N);
}

using Pass = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

// Every row of x against rows [n0, n1) of w, tile by tile: the rows of x in even passes of at most `most`.
void tiles(const Pass* passes, int64_t most, const float* x, const float* w, const float* bias, float* y,
           int64_t n0, int64_t n1, int64_t M, int64_t K, int64_t N) {
  const int64_t num_passes = (M + most - 1) / most;  // rows split evenly: 13 rows run as 7 + 6, not 12 + 1
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t i = 0, m0 = 0; i < num_passes; ++i) {
      const int64_t rows = (M - m0) / (num_passes - i);
      passes[rows](x + m0 * K, w, bias, y + m0 * N, t0, t1, K, N);
      m0 += rows;
    }
  }
}

void tiles(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t M, int64_t K, int64_t N) {
  static constexpr Pass stream[kStreamRows + 1] = {nullptr, stream_pass<1>, stream_pass<2>, stream_pass<3>, stream_pass<4>,
                                                   stream_pass<5>, stream_pass<6>, stream_pass<7>, stream_pass<8>,
                                                   stream_pass<9>, stream_pass<10>, stream_pass<11>, stream_pass<12>};
  static constexpr Pass blocked[kBlockX + 1] = {nullptr, blocked_pass<1>, blocked_pass<2>, blocked_pass<3>, blocked_pass<4>};
  static constexpr Pass blocked512[kBlockX512 + 1] = {nullptr, blocked_pass512<1>, blocked_pass512<2>, blocked_pass512<3>, blocked_pass512<4>,
                                                      blocked_pass512<5>, blocked_pass512<6>, blocked_pass512<7>, blocked_pass512<8>};
  const bool avx512 = tandem_kernels::use_avx512();
  if (M <= (avx512 ? kStreamMaxM512 : kStreamMaxM)) {
    tiles(stream, kStreamRows, x, w, bias, y, n0, n1, M, K, N);
  } else if (avx512) {
    tiles(blocked512, kBlockX512, x, w, bias, y, n0, n1, M, K, N);
  } else {
    tiles(blocked, kBlockX, x, w, bias, y, n0, n1, M, K, N);
  }
}

at::Tensor run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "small_gemm: x must be an fp32 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "small_gemm: x has ", x.size(-1), " features, w expects ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (M > 0 && N > 0) {
    at::parallel_for(0, N, kTile, [&](int64_t n0, int64_t n1) { tiles(xp, wp, bp, yp, n0, n1, M, K, N); });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// ---- weight-only int8 rows, interleaved ----------------------------------------------------------------------
// Layout (interleave_q8): rows in groups of kGroup, and within a group the k axis in chunks of 8:
// packed[g][c][r][0..8) = q[kGroup g + r][8c .. 8c + 8), zero-padded in N and K. A pass over a group reads its
// weights as one sequential stream and feeds kGroup independent FMA chains per row of x. Row-major int8 at M = 1
// had one chain per output and waited on the FMA latency (~7 GB/s of weights here), and reading 4 row-major rows
// side by side (4 streams) was slower still from DRAM. Each output is summed as the fp32 kernel sums (8 lanes over
// k, the lane reduction, the K % 8 tail), then scaled and biased: the same bits as the row-major int8 kernel it
// replaced, and batch-invariant whatever the rows of x or the passes.
constexpr int64_t kGroup = 4;
constexpr int kGroupRowsX = 3;  // rows of x per pass: 3 x 4 accumulators + 4 weight registers of 16

// The end of one int8 output: s (its 8-lane sum) + the K % 8 tail, times the row's scale, plus the bias. One compiled
// copy for the AVX2 and AVX-512 groups, so neither can round it differently (e.g. by contracting into FMAs).
__attribute__((noinline)) float q8_finish(float s, const float* x, const int8_t* tail, int64_t k0, int64_t K, float scale, const float* bias) {
  for (int64_t kk = k0; kk < K; ++kk) s += x[kk] * static_cast<float>(tail[kk - k0]);
  s *= scale;
  return bias ? s + *bias : s;
}

template <int M>
void q8_group(const float* x, const int8_t* group, const float* scale, const float* bias, float* y, int64_t n, int64_t K, int64_t N) {
  const int64_t full = K / 8;
  __m256 acc[M][kGroup];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kGroup; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    const int8_t* chunk = group + c * 8 * kGroup;
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + kPrefetchBytes, _MM_HINT_T0);
    __m256 wv[kGroup];
    for (int r = 0; r < kGroup; ++r) wv[r] = load8_i8(chunk + 8 * r);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + 8 * c);
      for (int r = 0; r < kGroup; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  const int8_t* tail = group + full * 8 * kGroup;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kGroup && n + r < N; ++r)
      y[m * N + n + r] = q8_finish(lane_sum(acc[m][r]), x + m * K, tail + 8 * r, 8 * full, K, scale[n + r], bias ? bias + n + r : nullptr);
}

// The AVX-512 group (CPUs that have it): the group's 4 rows widened into two registers (rows 0-1, rows 2-3: a chunk's
// 32 bytes are the 4 rows' 8 weights in a row) against each row of x broadcast to both halves, so every lane does
// q8_group's FMA for its output in the same k order, and each half is reduced by the same lane_sum: the same bits. Up
// to 12 rows of x per pass (24 accumulators), so the weights are widened once for a batch of up to 12 rows where the
// AVX2 group widens them again for every 3 (at 4 rows, two passes: ~3x the one-row time).
constexpr int kGroupRowsX512 = 12;

template <int M>
__attribute__((target("avx512f,avx512dq"))) void q8_group512(const float* x, const int8_t* group, const float* scale, const float* bias,
                                                           float* y, int64_t n, int64_t K, int64_t N) {
  static_assert(kGroup == 4, "two rows per register");
  const int64_t full = K / 8;
  __m512 acc[M][2];
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    const int8_t* chunk = group + c * 8 * kGroup;
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + kPrefetchBytes, _MM_HINT_T0);
    const __m512 w01 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk))));
    const __m512 w23 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16))));
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + m * K + 8 * c));
      acc[m][0] = _mm512_fmadd_ps(w01, xv, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w23, xv, acc[m][1]);
    }
  }
  const int8_t* tail = group + full * 8 * kGroup;
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < kGroup && n + r < N; ++r) {
      const __m512 pair = acc[m][r / 2];
      const float s = lane_sum(r % 2 ? _mm512_extractf32x8_ps(pair, 1) : _mm512_castps512_ps256(pair));
      y[m * N + n + r] = q8_finish(s, x + m * K, tail + 8 * r, 8 * full, K, scale[n + r], bias ? bias + n + r : nullptr);
    }
  }
}

void q8_groups(const float* x, const int8_t* packed, const float* scale, const float* bias, float* y, int64_t g0, int64_t g1,
               int64_t M, int64_t K, int64_t N) {
  using Pass = void (*)(const float*, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  static constexpr Pass passes[kGroupRowsX + 1] = {nullptr, q8_group<1>, q8_group<2>, q8_group<3>};
  static constexpr Pass passes512[kGroupRowsX512 + 1] = {nullptr, q8_group512<1>, q8_group512<2>, q8_group512<3>, q8_group512<4>,
                                                         q8_group512<5>, q8_group512<6>, q8_group512<7>, q8_group512<8>,
                                                         q8_group512<9>, q8_group512<10>, q8_group512<11>, q8_group512<12>};
  const bool avx512 = tandem_kernels::use_avx512();
  const Pass* table = avx512 ? passes512 : passes;
  const int64_t most = avx512 ? kGroupRowsX512 : kGroupRowsX;
  const int64_t num_passes = (M + most - 1) / most;  // rows split evenly, as tiles() does
  const int64_t group_bytes = (K + 7) / 8 * 8 * kGroup;
  for (int64_t g = g0; g < g1; ++g) {  // a group's weights (kGroup x K bytes) stay in L1 while every row of x passes
    for (int64_t i = 0, m0 = 0; i < num_passes; ++i) {
      const int64_t rows = (M - m0) / (num_passes - i);
      table[rows](x + m0 * K, packed + g * group_bytes, scale, bias, y + m0 * N, g * kGroup, K, N);
      m0 += rows;
    }
  }
}

}  // namespace

// Entry points, also called by decode_glue.cpp's whole-stack forward (declared in gemm.h).
namespace tandem_kernels {

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu(), "small_gemm: w must be an fp32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "small_gemm: w must be a contiguous [N, K] matrix");
  return run(x, w, checked_bias(bias, w.size(0), "small_gemm"));
}

// Weight-only int8: packed = interleave_q8(q) for q [N, K] int8 with one fp32 scale per row (w ~ scale[n] * q[n, :]);
// activations stay fp32, so the result is exact for the int8 weights and batch-invariant like the fp32 kernel.
at::Tensor small_gemm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  static_assert(kGroup == 4, "checked_q8 (gemm.h) checks groups of 4 rows");
  const int64_t N = checked_q8(x, packed, scale, "small_gemm_q8"), K = x.size(-1);
  const at::Tensor b = checked_bias(bias, N, "small_gemm_q8");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x2.data_ptr<float>(), *sp = scale.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int8_t* wp = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  if (M > 0 && N > 0) {
    at::parallel_for(0, packed.size(0), kTile / kGroup, [&](int64_t g0, int64_t g1) { q8_groups(xp, wp, sp, bp, yp, g0, g1, M, K, N); });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace tandem_kernels

namespace {

// Symmetric weight-only int8 rows: scale[n] = max |w[n, :]| / 127, q = round(w / scale) in [-127, 127]. One pass
// per row (the torch-op version took ~80 ms for a 16k x 576 draft LM head, a stall at every hot-swap).
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
      for (int64_t k = 0; k < K; ++k) {
        qp[n * K + k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(row[k] / step))));
      }
    }
  });
  return {q, scale};
}

// q [N, K] int8 -> small_gemm_q8's layout [ceil(N/4), ceil(K/8), 4, 8] (zeros in the padding).
at::Tensor interleave_q8(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.device().is_cpu() && q.dim() == 2, "interleave_q8: int8 CPU [N, K] only");
  const at::Tensor qc = q.contiguous();
  const int64_t N = qc.size(0), K = qc.size(1), G = (N + kGroup - 1) / kGroup, C = (K + 7) / 8;
  at::Tensor out = at::zeros({G, C, kGroup, 8}, qc.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int8_t* row = dst + (n / kGroup * C * kGroup + n % kGroup) * 8;  // chunk c of row n is at row + c * 8 * kGroup
      for (int64_t c = 0; c < C; ++c) std::memcpy(row + c * 8 * kGroup, src + n * K + 8 * c, std::min<int64_t>(8, K - 8 * c));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_gemm_q8(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("quantize_rows(Tensor weight) -> (Tensor, Tensor)");
  m.def("interleave_q8(Tensor q) -> Tensor");
  m.def("set_isa(str isa) -> str", &tandem_kernels::set_isa);
  m.def("current_isa() -> str", &tandem_kernels::current_isa);
  m.def("set_prefetch(int bytes) -> int", &tandem_kernels::set_prefetch);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("small_gemm", &tandem_kernels::small_gemm);
  m.impl("small_gemm_q8", &tandem_kernels::small_gemm_q8);
  m.impl("quantize_rows", &quantize_rows);
  m.impl("interleave_q8", &interleave_q8);
}
