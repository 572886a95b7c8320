// y = x @ w^T (+ bias) for fp32 activations with many rows per sequence (prefill: more than 16 new tokens), w the
// same plain row-major [N, K] weight the small-M kernel reads (the model keeps one copy).
//
// Why: small_gemm.cpp sums each output as a dot product (8 lanes over k, a lane reduction), which keeps a decode
// row's bits independent of the batch but leaves compute on the table once there are many rows. Here each thread
// packs 16 rows of w at a time into a [K][16] panel (transposed in registers) and runs a 6 x 16 outer-product
// register block over it: 12 accumulators, 2 panel loads and 6 broadcasts per 12 FMAs, no lane reductions
// (~1.1-1.3x small_gemm from 17 rows on, docs/BENCHMARKS.md 1.7); with AVX-512, 32 rows per panel and a 12 x 32
// block.
// The same blocks also serve the prefill's MLP gate (wide_gemm_silu: gate and up columns in one panel, SiLU in the
// epilogue) and its causal attention (prefill_attention: scores and weighted values as GEMMs over packed K / V panels).
//
// Each y[m, n] is one accumulator lane fed k = 0, 1, ..., K - 1 in order, then the bias: the result does not
// depend on M, on the row blocking or on the thread split, so a prompt prefilled alone or in a padded batch, or
// in chunks of more than 16 tokens, gets the same bits. It is not the small-M kernel's summation order: a
// prefill and a decode step of the same tokens may round differently (decode and verify never use this kernel).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gemm.h"
#include "simd.h"

namespace {

constexpr int kNR = 16;  // columns of a panel: two ymm
constexpr int kMR = 6;  // rows of x per register block: 6 x 2 accumulators + 2 panel loads + 1 broadcast of 16 ymm

// 8 x 8 floats transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// P[k][col0 + j] = w[r0 + j][k] for j < width, zeros for rows from `end` on; the panel's other columns untouched.
void pack_columns(const float* w, float* P, int64_t r0, int64_t end, int64_t K, int64_t nr, int64_t col0, int64_t width) {
  const int64_t cols = std::min<int64_t>(width, end - r0);
  if (cols < width || K % 8) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < width; ++j) P[k * nr + col0 + j] = j < cols ? w[(r0 + j) * K + k] : 0.f;
    return;
  }
  for (int64_t part = 0; part < width / 8; ++part) {
    const float* rows = w + (r0 + 8 * part) * K;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows + j * K + k);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(P + (k + i) * nr + col0 + 8 * part, r[i]);
    }
  }
}

// P [K][nr]: rows n0..n0+nr of w transposed (zeros past N); nr is 16 (the AVX2 block) or 32 (the AVX-512 block).
void pack_panel(const float* w, float* P, int64_t n0, int64_t N, int64_t K, int64_t nr) { pack_columns(w, P, n0, N, K, nr, 0, nr); }

// A gated panel of a fused gate/up weight w [2I, K] (gate rows, then up rows): columns [0, nr/2) from gate rows
// n0.., columns [nr/2, nr) from the matching up rows I + n0.. (zeros past I), so one register block holds both.
void pack_panel_gated(const float* w, float* P, int64_t n0, int64_t I, int64_t K, int64_t nr) {
  pack_columns(w, P, n0, I, K, nr, 0, nr / 2);
  pack_columns(w, P, I + n0, 2 * I, K, nr, nr / 2, nr / 2);
}

// P [K][nr]: columns n0..n0+nr of a row-major [K, N] matrix b (zeros past N), i.e. the panel of b^T, copied as it lies.
void pack_panel_kn(const float* b, float* P, int64_t n0, int64_t N, int64_t K, int64_t nr) {
  const int64_t cols = std::min<int64_t>(nr, N - n0);
  for (int64_t k = 0; k < K; ++k) {
    std::copy(b + k * N + n0, b + k * N + n0 + cols, P + k * nr);
    std::fill(P + k * nr + cols, P + (k + 1) * nr, 0.f);
  }
}

// The gated epilogue: silu(gate) * up for `cols` output columns, gate in g[0..lanes), up in u[0..lanes), 8 lanes at a
// time (lanes past `cols` come from the panel's zero columns and are not stored), into y.
inline void store_silu_mul(const float* g, const float* u, float* y, int64_t cols, int64_t lanes) {
  alignas(32) float out[16];
  for (int64_t h = 0; h < lanes; h += 8) _mm256_store_ps(out + h, silu_mul8(_mm256_loadu_ps(g + h), _mm256_loadu_ps(u + h)));
  for (int64_t j = 0; j < cols; ++j) y[j] = out[j];
}

template <int MR, bool Gated>
void block(const float* x, const float* P, const float* bias, float* y, int64_t n0, int64_t N, int64_t K) {
  // y[m, n0 + j] = sum_k x[m, k] P[k][j] (+ bias) for the MR rows of x at x. (The accumulators stay in registers only
  // while every loop over m is unrolled: GCC spills an array of __m256 that a rolled loop indexes.)
  const int64_t cols = std::min<int64_t>(Gated ? kNR / 2 : kNR, N - n0);
  alignas(32) float out[MR][kNR];
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 p0 = _mm256_loadu_ps(P + k * kNR), p1 = _mm256_loadu_ps(P + k * kNR + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xv, p0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, p1, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(out[m], acc[m][0]);
    _mm256_store_ps(out[m] + 8, acc[m][1]);
  }
  if (Gated) {  // out[m] holds 8 gate then the 8 matching up columns
    for (int m = 0; m < MR; ++m) store_silu_mul(out[m], out[m] + kNR / 2, y + m * N + n0, cols, kNR / 2);
    return;
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < cols; ++j) y[m * N + n0 + j] = bias ? out[m][j] + bias[n0 + j] : out[m][j];
}

using Block = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);

// The AVX-512 block, where the CPU has it (Zen 4/5, recent Xeons): a [K][32] panel, two zmm per panel row and 12 rows
// of x per block (24 accumulators, 2 panel loads and 12 broadcasts per 24 FMAs of twice the width; a 12 x 16 block
// over the AVX2 panel spent as many loads as FMAs and ran ~300 GFLOP/s on the model's shapes). Each y[m, n] is still
// one lane fed k = 0, 1, ..., K - 1 in order by fused multiply-adds, then the bias: the same operations as `block`,
// so the same bits (tested), only more of them per instruction.
constexpr int kNR512 = 32;
constexpr int kMR512 = 12;

template <int MR, bool Gated>
__attribute__((target("avx512f"))) void block512(const float* x, const float* P, const float* bias, float* y, int64_t n0, int64_t N, int64_t K) {
  const int64_t cols = std::min<int64_t>(Gated ? kNR512 / 2 : kNR512, N - n0);
  auto mask = [](int64_t c) { return c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(c, 0)) - 1); };
  const __mmask16 keep0 = mask(cols), keep1 = mask(cols - 16);
  __m512 acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 p0 = _mm512_loadu_ps(P + k * kNR512), p1 = _mm512_loadu_ps(P + k * kNR512 + 16);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, p0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, p1, acc[m][1]);
    }
  }
  if (Gated) {  // acc[m][0]: 16 gate columns, acc[m][1]: the matching up columns
    alignas(64) float g[16], u[16];
    for (int m = 0; m < MR; ++m) {
      _mm512_store_ps(g, acc[m][0]);
      _mm512_store_ps(u, acc[m][1]);
      store_silu_mul(g, u, y + m * N + n0, cols, 16);
    }
    return;
  }
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(keep0, bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(keep1, bias + n0 + 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * N + n0, keep0, bias ? _mm512_add_ps(acc[m][0], b0) : acc[m][0]);
    _mm512_mask_storeu_ps(y + m * N + n0 + 16, keep1, bias ? _mm512_add_ps(acc[m][1], b1) : acc[m][1]);
  }
}

template <bool Gated>
constexpr Block kBlocks[kMR + 1] = {nullptr, block<1, Gated>, block<2, Gated>, block<3, Gated>, block<4, Gated>, block<5, Gated>, block<6, Gated>};
template <bool Gated>
constexpr Block kBlocks512[kMR512 + 1] = {nullptr, block512<1, Gated>, block512<2, Gated>, block512<3, Gated>, block512<4, Gated>,
                                          block512<5, Gated>, block512<6, Gated>, block512<7, Gated>, block512<8, Gated>,
                                          block512<9, Gated>, block512<10, Gated>, block512<11, Gated>, block512<12, Gated>};

// Every row of x against panels [p0, p1) of the weight (nr columns each, `step` output columns: nr, or nr / 2 for a
// gated panel), `rows` rows of x per block (blocks[r] runs r rows); Pack fills the panel of output columns n0...
template <typename Pack>
void panels(const Pack& pack, const Block* blocks, int rows, int64_t nr, int64_t step, const float* x, const float* bias, float* y, int64_t p0,
            int64_t p1, int64_t M, int64_t K, int64_t N) {
  std::vector<float> P((K + 7) / 8 * 8 * nr);  // this thread's panel
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * step;
    pack(P.data(), n0, nr);
    int64_t m = 0;
    for (; m + rows <= M; m += rows) blocks[rows](x + m * K, P.data(), bias, y + m * N, n0, N, K);
    if (m < M) blocks[M - m](x + m * K, P.data(), bias, y + m * N, n0, N, K);
  }
}

// y [..., N] = x [..., K] times the weight Pack reads; gated: N = I outputs silu(gate) * up from gated panels.
template <typename Pack>
at::Tensor run(const at::Tensor& x, int64_t N, const at::Tensor& b, const Pack& pack, bool gated = false) {
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x2.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (M > 0 && N > 0) {
    const bool avx512 = tandem_kernels::use_avx512();
    const Block* blocks = avx512 ? (gated ? kBlocks512<true> : kBlocks512<false>) : (gated ? kBlocks<true> : kBlocks<false>);
    const int rows = avx512 ? kMR512 : kMR;
    const int64_t nr = avx512 ? kNR512 : kNR, step = gated ? nr / 2 : nr;
    at::parallel_for(0, (N + step - 1) / step, 1, [&](int64_t p0, int64_t p1) { panels(pack, blocks, rows, nr, step, xp, bp, yp, p0, p1, M, K, N); });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

at::Tensor wide_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "wide_gemm: w must be a contiguous fp32 CPU [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K, "wide_gemm: x must be fp32 CPU [..., ", K, "]");
  const float* wp = w.data_ptr<float>();
  return run(x, N, tandem_kernels::checked_bias(bias, N, "wide_gemm"), [&](float* P, int64_t n0, int64_t nr) { pack_panel(wp, P, n0, N, K, nr); });
}

// x @ b for a row-major [K, N] b: a linear's backward (dX = dY W, dW = dY^T X) without transposed copies of W or X.
// The same block and summation order as wide_gemm(x, b^T), so the same bits.
at::Tensor wide_gemm_kn(const at::Tensor& x, const at::Tensor& b) {
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.device().is_cpu() && b.dim() == 2 && b.is_contiguous(), "wide_gemm_kn: b must be a contiguous fp32 CPU [K, N] matrix");
  const int64_t K = b.size(0), N = b.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K, "wide_gemm_kn: x must be fp32 CPU [..., ", K, "]");
  const float* bp = b.data_ptr<float>();
  return run(x, N, at::Tensor(), [&](float* P, int64_t n0, int64_t nr) { pack_panel_kn(bp, P, n0, N, K, nr); });
}

// silu(x w_gate^T) * (x w_up^T) for a fused gate/up weight w [2I, K] (gate rows first): [..., I], the same bits as
// silu_mul(wide_gemm(x, w)) (each gate and up value is the same lane fed the same products in the same order, and the
// epilogue is silu_mul's formula), without writing or re-reading the [..., 2I] product (a prefill's MLP).
at::Tensor wide_gemm_silu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.size(0) % 2 == 0,
              "wide_gemm_silu: w must be a contiguous fp32 CPU [2I, K] matrix");
  const int64_t I = w.size(0) / 2, K = w.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K, "wide_gemm_silu: x must be fp32 CPU [..., ", K, "]");
  const float* wp = w.data_ptr<float>();
  return run(x, I, at::Tensor(), [&](float* P, int64_t n0, int64_t nr) { pack_panel_gated(wp, P, n0, I, K, nr); }, true);
}


// Causal self-attention of one fresh prompt (a prefill), on the wide kernel's register blocks. q [n, H, D] (any
// strides), k and v [Hkv, n, D] with contiguous rows (a cache row's slice), H a multiple of Hkv; returns [n, H D]:
// softmax(q k^T * scale, causal) v per head, query head h reading kv head h / (H / Hkv).
//
// Why: SDPA spent ~25 % of a 137-token prefill here (0.9 ms a layer for ~22 MFLOP). Per kv head, the query rows of
// its G heads at 12 / G positions at a time (t-major, one register block of rows) are scored against the visible
// keys as a GEMM (keys packed as [D][nr] panels, so no lane reductions), softmaxed row by row in place (exp8) and
// multiplied by the values (panels of v's columns): the key panels past a block's last position are never
// computed, about half of the full product. Each output is one query row's own computation in a fixed order, so a
// prompt gets the same bits alone or packed with others. Not SDPA's summation order (fp32 rounding apart).
at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat && q_in.device().is_cpu(), "prefill_attention: q must be fp32 CPU [n, H, D]");
  const at::Tensor q = q_in.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == n && k.size(2) == D && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "prefill_attention: k and v must be fp32 [Hkv, n, D] with contiguous rows");
  const int64_t Hkv = k.size(0);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "prefill_attention: query heads must be a multiple of the kv heads");
  at::Tensor out = at::empty({n, H * D}, q.options());
  if (n == 0) return out;
  const bool avx512 = tandem_kernels::use_avx512();
  const Block* blocks = avx512 ? kBlocks512<false> : kBlocks<false>;
  const int rows = avx512 ? kMR512 : kMR;
  const int64_t nr = avx512 ? kNR512 : kNR, G = H / Hkv;
  const int64_t positions = std::max<int64_t>(1, rows / G);  // query positions per block: G heads each
  const int64_t n_pad = (n + nr - 1) / nr * nr, key_panels = n_pad / nr, value_panels = (D + nr - 1) / nr;
  // Per kv head: keys as [D][nr] panels (score GEMM), values as [n_pad][nr] column panels (rows past n zero).
  std::vector<float> keys(Hkv * key_panels * D * nr), values(Hkv * value_panels * n_pad * nr, 0.f);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = q.data_ptr<float>();
  at::parallel_for(0, Hkv, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t p = 0; p < key_panels; ++p)
        pack_columns(kp + g * k.stride(0), keys.data() + (g * key_panels + p) * D * nr, p * nr, n, D, nr, 0, nr);
      for (int64_t c = 0; c < value_panels; ++c)
        pack_panel_kn(vp + g * v.stride(0), values.data() + (g * value_panels + c) * n_pad * nr, c * nr, D, n, nr);
    }
  });
  const int64_t blocks_per_head = (n + positions - 1) / positions, items = Hkv * blocks_per_head;
  const float fscale = static_cast<float>(scale);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> x(positions * G * D), scores(positions * G * n_pad), o(positions * G * value_panels * nr);
    for (int64_t i = i0; i < i1; ++i) {
      // early and late blocks alternate, so a thread's contiguous share of items has a fair share of keys
      const int64_t pair = i / Hkv, g = i % Hkv;
      const int64_t b = pair % 2 == 0 ? pair / 2 : blocks_per_head - 1 - pair / 2;
      const int64_t t0 = b * positions, t1 = std::min(n, t0 + positions), m = (t1 - t0) * G;
      const int64_t visible = (t1 + nr - 1) / nr * nr;  // keys 0..t1-1, whole panels
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < G; ++h) std::copy(qp + (t * H + g * G + h) * D, qp + (t * H + g * G + h + 1) * D, x.data() + ((t - t0) * G + h) * D);
      // y[r, n0..n0+nr) = a[r, :depth] . panel for the block's m rows (a's rows depth apart, y's ldy apart)
      auto gemm = [&](const float* a, const float* panel, float* y, int64_t n0, int64_t ldy, int64_t depth) {
        int64_t r = 0;
        for (; r + rows <= m; r += rows) blocks[rows](a + r * depth, panel, nullptr, y + r * ldy, n0, ldy, depth);
        if (r < m) blocks[m - r](a + r * depth, panel, nullptr, y + r * ldy, n0, ldy, depth);
      };
      for (int64_t p = 0; p * nr < visible; ++p) gemm(x.data(), keys.data() + (g * key_panels + p) * D * nr, scores.data(), p * nr, visible, D);
      for (int64_t r = 0; r < m; ++r) {  // row r: position t0 + r / G sees keys 0..t
        float* row = scores.data() + r * visible;
        const int64_t seen = t0 + r / G + 1;
        float best = -INFINITY;
        for (int64_t j = 0; j < seen; ++j) best = std::max(best, row[j] * fscale);
        for (int64_t j = 0; j < seen; ++j) row[j] = row[j] * fscale - best;
        exp_inplace(row, seen);
        float total = 0.f;
        for (int64_t j = 0; j < seen; ++j) total += row[j];
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < seen; ++j) row[j] *= inv;
        std::fill(row + seen, row + visible, 0.f);
      }
      for (int64_t c = 0; c < value_panels; ++c)
        gemm(scores.data(), values.data() + (g * value_panels + c) * n_pad * nr, o.data(), c * nr, value_panels * nr, visible);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t t = t0 + r / G, h = g * G + r % G;
        std::copy(o.data() + r * value_panels * nr, o.data() + r * value_panels * nr + D, op + (t * H + h) * D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("wide_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("wide_gemm_kn(Tensor x, Tensor b) -> Tensor");
  m.def("wide_gemm_silu(Tensor x, Tensor w) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("wide_gemm", &wide_gemm);
  m.impl("wide_gemm_kn", &wide_gemm_kn);
  m.impl("wide_gemm_silu", &wide_gemm_silu);
  m.impl("prefill_attention", &prefill_attention);
}
