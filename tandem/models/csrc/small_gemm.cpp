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

}  // namespace

// Entry points, also called by decode_glue.cpp's whole-stack forward (declared in gemm.h).
namespace tandem_kernels {

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu(), "small_gemm: w must be an fp32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "small_gemm: w must be a contiguous [N, K] matrix");
  return run(x, w, checked_bias(bias, w.size(0), "small_gemm"));
}

}  // namespace tandem_kernels

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("set_isa(str isa) -> str", &tandem_kernels::set_isa);
  m.def("current_isa() -> str", &tandem_kernels::current_isa);
  m.def("set_prefetch(int bytes) -> int", &tandem_kernels::set_prefetch);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("small_gemm", &tandem_kernels::small_gemm);
}
