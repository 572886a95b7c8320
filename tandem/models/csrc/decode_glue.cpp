// The per-layer glue of a decode / verify forward as a few fused CPU ops (fp32): RMSNorm (with the residual
// add), SiLU-gate, and RoPE + KV-cache write + attention of a few new queries over the cached prefix.
//
// Why: between the GEMMs an eager layer runs ~35 small torch ops (views, casts, a roll for RoPE, the cache
// copies, SDPA's set-up for one query); at a few microseconds of dispatch each that was ~15 ms of a 55-60 ms
// SmolLM2 token on the 2-core box (docs/BENCHMARKS.md 1.5). Here each is one call.
//
// Batch invariance, as in small_gemm.cpp: every output is computed from its own row in one fixed order (a
// query's scores key by key, its softmax, its weighted sum), so a row inside a k-token verify or a ragged
// batch gets the same bits as the same row alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "gemm.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// sum_i a[i] * b[i] in a fixed order: 8 lanes over steps of 8, the lane reduction, then the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

// y = w * (x * rsqrt(mean(x^2) + eps)) for one row of n features.
inline void norm_row(const float* x, const float* w, float eps, float* y, int64_t n) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// Rows [0, rows) of a row-wise op, split among the threads once there are enough of them (a prefill, a wide
// decode batch); one row, or a few, run inline. Each row is computed alone, so the split changes no value.
template <typename F>
void for_rows(int64_t rows, int64_t row_floats, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, row_floats));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous(), op, ": x must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.numel() == x.size(-1), op, ": weight must be fp32 [", x.size(-1), "]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_rows(rows, n, [&](int64_t r) { norm_row(xp + r * n, wp, static_cast<float>(eps), yp + r * n, n); });
  return y;
}

// (x + residual, rms_norm(x + residual)): the residual stream and the next sub-layer's input in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(), "add_rms_norm: residual must match x");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *yp = y.data_ptr<float>();
  for_rows(rows, n, [&](int64_t r) {
    for (int64_t i = r * n; i < (r + 1) * n; ++i) sp[i] = rp[i] + xp[i];
    norm_row(sp + r * n, wp, static_cast<float>(eps), yp + r * n, n);
  });
  return {sum, y};
}

// [..., 2I] (gate | up) -> [..., I]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous fp32 [..., 2I]");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = width;
  at::Tensor y = at::empty(shape, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_rows(rows, 2 * width, [&](int64_t r) {
    const float *gr = g + r * 2 * width, *ur = gr + width;
    float* yr = yp + r * width;
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
    if (i < width) {  // the tail through padded copies, so every value takes the same formula
      float gt[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ut[8] = {0, 0, 0, 0, 0, 0, 0, 0}, yt[8];
      std::copy(gr + i, gr + width, gt);
      std::copy(ur + i, ur + width, ut);
      _mm256_storeu_ps(yt, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
      std::copy(yt, yt + (width - i), yr + i);
    }
  });
  return y;
}

// x*cos + rotate_half(x)*sin for one head of d features, cos / sin_signed as the eager path builds them
// ([cos, cos] and [-sin, sin]): dst[i] = fma(src[i +- d/2], sin[i], src[i] * cos[i]), 8 lanes at a time when d/2
// is a multiple of 8 (the scalar loop computes the same expression); src and dst must not alias.
inline void rope_head(const float* src, const float* cos, const float* sin_signed, float* dst, int64_t d) {
  const int64_t half = d / 2;
  if (half % 8 == 0) {
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 rotated = _mm256_loadu_ps(src + (i < half ? i + half : i - half));
      _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(rotated, _mm256_loadu_ps(sin_signed + i), _mm256_mul_ps(_mm256_loadu_ps(src + i), _mm256_loadu_ps(cos + i))));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) dst[i] = std::fma(src[(i + half) % d], sin_signed[i], src[i] * cos[i]);
}

// How far ahead the score loop prefetches: the next key into L1, and the values 1 KB ahead into L2, so the value pass
// that follows finds them there instead of waiting on DRAM (a batched decode's cache is tens of MB: attention took
// a quarter of a 60-row step, and this made it ~1.28x faster, BENCHMARKS 1.8). Prefetches move no value.
constexpr int64_t kKeyPrefetchBytes = 256, kValuePrefetchBytes = 1024;

// Whether slot j is visible to new token t of a row with `prefix` cached tokens: the prefix always, the new tokens as
// the row's tree allows (causal without one).
inline bool visible(int64_t j, int64_t prefix, const bool* allowed, int64_t t) {
  const int64_t u = j - prefix;
  return u < 0 || (allowed ? allowed[u] : u <= t);
}

// While key j is scored: the next key toward L1 and the value rows ahead toward L2 (value = nullptr: none), one
// prefetch per cache line of 16 floats.
inline void prefetch_ahead(const float* key, const float* value, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(key + d) + kKeyPrefetchBytes, _MM_HINT_T0);
    if (value) _mm_prefetch(reinterpret_cast<const char*>(value + d) + kValuePrefetchBytes, _MM_HINT_T1);
  }
}

// A row of D floats toward L2 (the next item's keys, while this item's values are summed).
inline void prefetch_row_l2(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
}

// Scores of NH query heads (consecutive, D apart) against keys 0..S-1: sc[h * stride + j] = (q_h . k_j) * scale,
// -inf where the key is not visible. Each dot keeps 16 lanes (two registers) over D in order, adds its halves, then
// lane_sum: the same bits whatever NH (each head has its own accumulators), so splitting a group's heads across
// threads changes nothing, and the order head_scores512 takes with one AVX-512 register, so either ISA gives the same
// bits. values (or nullptr): the matching value rows, prefetched while the keys are scored.
template <int NH>
void head_scores(const float* q, const float* keys, const float* values, int64_t S, int64_t D, float scale, int64_t prefix,
                 const bool* allowed, int64_t t, float* sc, int64_t stride) {
  for (int64_t j = 0; j < S; ++j) {
    if (!visible(j, prefix, allowed, t)) {
      for (int h = 0; h < NH; ++h) sc[h * stride + j] = -INFINITY;
      continue;
    }
    const float* key = keys + j * D;
    prefetch_ahead(key, values ? values + j * D : nullptr, D);
    __m256 lo[NH], hi[NH];  // lanes 0-7 and 8-15 of each 16 features
    for (int h = 0; h < NH; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m256 k0 = _mm256_loadu_ps(key + d), k1 = _mm256_loadu_ps(key + d + 8);
      for (int h = 0; h < NH; ++h) {
        lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, lo[h]);
        hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d + 8), k1, hi[h]);
      }
    }
    if (d < D) {  // D = 16 n + 8
      const __m256 k0 = _mm256_loadu_ps(key + d);
      for (int h = 0; h < NH; ++h) lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, lo[h]);
    }
    for (int h = 0; h < NH; ++h) sc[h * stride + j] = lane_sum(_mm256_add_ps(lo[h], hi[h])) * scale;
  }
}

// head_scores with 16 lanes (AVX-512) for D = 16 DC: the group's queries stay in registers and each key is loaded once
// for all NH heads (the AVX2 form re-reads the queries from L1 at every key). The same multiply-adds in the same
// order, so the same bits.
template <int NH, int DC>
__attribute__((target("avx512f"))) void head_scores512(const float* q, const float* keys, const float* values, int64_t S, float scale,
                                                     int64_t prefix, const bool* allowed, int64_t t, float* sc, int64_t stride) {
  constexpr int64_t D = 16 * DC;
  __m512 qr[NH][DC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < DC; ++c) qr[h][c] = _mm512_loadu_ps(q + h * D + 16 * c);
  for (int64_t j = 0; j < S; ++j) {
    if (!visible(j, prefix, allowed, t)) {
      for (int h = 0; h < NH; ++h) sc[h * stride + j] = -INFINITY;
      continue;
    }
    const float* key = keys + j * D;
    prefetch_ahead(key, values ? values + j * D : nullptr, D);
    __m512 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
    for (int c = 0; c < DC; ++c) {
      const __m512 kc = _mm512_loadu_ps(key + 16 * c);
      for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(qr[h][c], kc, acc[h]);
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 lo = _mm512_castps512_ps256(acc[h]), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h]), 1));
      sc[h * stride + j] = lane_sum(_mm256_add_ps(lo, hi)) * scale;
    }
  }
}

// In place: sc[0..S) -> softmax(sc). The sum runs key by key in order, so keys a query cannot see (e^-inf = 0,
// wherever they sit in a verify's tree) add exact zeros: a row gets the same bits as the same path decoded alone.
inline void softmax_row(float* sc, int64_t S) {
  __m256 best8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= S; j += 8) best8 = _mm256_max_ps(best8, _mm256_loadu_ps(sc + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, best8);
  float best = -INFINITY;
  for (int i = 0; i < 8; ++i) best = std::max(best, lanes[i]);
  for (; j < S; ++j) best = std::max(best, sc[j]);
  for (j = 0; j < S; ++j) sc[j] -= best;
  exp_inplace(sc, S);
  float total = 0.f;
  for (j = 0; j < S; ++j) total += sc[j];
  const float inv = 1.0f / total;
  for (j = 0; j < S; ++j) sc[j] *= inv;
}

// out_h[d] = sum_j p_h[j] v_j[d] for NH heads, CH chunks of 8 features per pass (NH x CH accumulators in registers),
// each output summed over j in order: the same bits whatever NH and CH.
template <int NH, int CH>
void weighted_values(const float* p, int64_t stride, const float* values, int64_t S, int64_t D, float* out,
                     const float* next_keys = nullptr, int64_t next_S = 0) {
  for (int64_t d0 = 0; d0 < D; d0 += 8 * CH) {
    const float* ahead = d0 == 0 ? next_keys : nullptr;
    const int chunks = static_cast<int>(std::min<int64_t>(CH, (D - d0) / 8));
    __m256 acc[NH][CH];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < CH; ++c) acc[h][c] = _mm256_setzero_ps();
    if (chunks == CH) {
      for (int64_t j = 0; j < S; ++j) {
        if (ahead && j < next_S) prefetch_row_l2(ahead + j * D, D);
        __m256 vj[CH];
        for (int c = 0; c < CH; ++c) vj[c] = _mm256_loadu_ps(values + j * D + d0 + 8 * c);
        for (int h = 0; h < NH; ++h) {
          const __m256 w = _mm256_broadcast_ss(p + h * stride + j);
          for (int c = 0; c < CH; ++c) acc[h][c] = _mm256_fmadd_ps(w, vj[c], acc[h][c]);
        }
      }
    } else {
      for (int64_t j = 0; j < S; ++j) {
        for (int h = 0; h < NH; ++h) {
          const __m256 w = _mm256_broadcast_ss(p + h * stride + j);
          for (int c = 0; c < chunks; ++c) acc[h][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + j * D + d0 + 8 * c), acc[h][c]);
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(out + h * D + d0 + 8 * c, acc[h][c]);
  }
}

// weighted_values with 16 lanes (AVX-512, D a multiple of 16): each output is the same sum over j in the same order,
// so the same bits, in half the instructions (one pass over the values where the AVX2 form, short of registers,
// spilled its accumulators and made two).
template <int NH, int CH>
__attribute__((target("avx512f"))) void weighted_values512(const float* p, int64_t stride, const float* values, int64_t S, int64_t D,
                                                         float* out, const float* next_keys, int64_t next_S) {
  for (int64_t d0 = 0; d0 < D; d0 += 16 * CH) {
    const float* ahead = d0 == 0 ? next_keys : nullptr;
    const int chunks = static_cast<int>(std::min<int64_t>(CH, (D - d0) / 16));
    __m512 acc[NH][CH];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < CH; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; ++j) {
      if (ahead && j < next_S) prefetch_row_l2(ahead + j * D, D);
      if (chunks == CH) {
        __m512 vj[CH];
        for (int c = 0; c < CH; ++c) vj[c] = _mm512_loadu_ps(values + j * D + d0 + 16 * c);
        for (int h = 0; h < NH; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * stride + j]);
          for (int c = 0; c < CH; ++c) acc[h][c] = _mm512_fmadd_ps(w, vj[c], acc[h][c]);
        }
      } else {
        for (int h = 0; h < NH; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * stride + j]);
          for (int c = 0; c < chunks; ++c) acc[h][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(values + j * D + d0 + 16 * c), acc[h][c]);
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(out + h * D + d0 + 16 * c, acc[h][c]);
  }
}

// One query token against its visible keys for NH consecutive query heads sharing a kv head; prefetch_values: bring
// the values toward the core during the score pass (off when a group's heads are separate items: they would each
// prefetch the same rows).
template <int NH>
void attend_heads(const float* q, const float* keys, const float* values, int64_t S, int64_t D, float scale, int64_t prefix,
                  const bool* allowed, int64_t t, float* sc, float* out, bool prefetch_values, const float* next_keys, int64_t next_S) {
  const float* prefetched = prefetch_values ? values : nullptr;
  const bool avx512 = tandem_kernels::use_avx512();
  if (avx512 && D == 64) head_scores512<NH, 4>(q, keys, prefetched, S, scale, prefix, allowed, t, sc, S);
  else if (avx512 && D == 128) head_scores512<NH, 8>(q, keys, prefetched, S, scale, prefix, allowed, t, sc, S);
  else head_scores<NH>(q, keys, prefetched, S, D, scale, prefix, allowed, t, sc, S);
  for (int h = 0; h < NH; ++h) softmax_row(sc + h * S, S);
  if (avx512 && D % 16 == 0) {
    constexpr int CH = NH <= 2 ? 8 : NH <= 6 ? 4 : 2;  // NH x CH accumulators + CH value chunks <= 29 of 32 registers
    if (D == 64 && CH > 4) weighted_values512<NH, 4>(sc, S, values, S, D, out, next_keys, next_S);  // a whole head per pass
    else weighted_values512<NH, CH>(sc, S, values, S, D, out, next_keys, next_S);
    return;
  }
  constexpr int CH = NH == 1 ? 8 : NH <= 3 ? 4 : NH <= 6 ? 2 : 1;  // NH x CH <= 12 accumulators of 16 registers
  weighted_values<NH, CH>(sc, S, values, S, D, out, next_keys, next_S);
}

using AttendHeads = void (*)(const float*, const float*, const float*, int64_t, int64_t, float, int64_t, const bool*, int64_t, float*, float*, bool,
                            const float*, int64_t);
constexpr AttendHeads kAttendHeads[9] = {nullptr, attend_heads<1>, attend_heads<2>, attend_heads<3>, attend_heads<4>,
                                         attend_heads<5>, attend_heads<6>, attend_heads<7>, attend_heads<8>};

// Attention of the T new tokens of a batch of cached rows, after writing their rotated keys and values into
// the cache. qkv [B, T, (H + 2 Hkv) D] (the fused projection, bias included); cos / sin_signed [B, T, D];
// q_norm / k_norm: per-head RMSNorm weights [D] applied before RoPE (Qwen3), or undefined; cache_k / cache_v
// [L, Bmax, Hkv, Smax, D], this forward's rows are row0 .. row0 + B - 1 of layer `layer`; starts [B] int64:
// cached tokens per row before this forward; tree [B, T, T] bool (new token t sees new token u), undefined =
// causal. New token t of row b sits at slot starts[b] + t and sees slots [0, starts[b]) and the new tokens its
// tree row allows. Returns [B, T, H D]. Ragged (lengths [B] defined, a verify whose rows draft different amounts):
// qkv [N, 1, F] holds row b's lengths[b] new tokens one after another (N = their sum), cos / sin_signed [N, 1, D],
// tree [N, longest row] (token i sees its row's new token u) or undefined = causal; returns [N, 1, H D].
at::Tensor attend_cached(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                         at::Tensor cache_k, at::Tensor cache_v, int64_t layer, int64_t row0, const at::Tensor& starts,
                         const c10::optional<at::Tensor>& tree, int64_t num_heads, int64_t num_kv_heads,
                         const c10::optional<at::Tensor>& lengths) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "attend_cached: qkv must be contiguous fp32 [B, T, F]");
  TORCH_CHECK(cache_k.scalar_type() == at::kFloat && cache_k.is_contiguous() && cache_v.is_contiguous() && cache_k.dim() == 5 &&
              cache_v.sizes() == cache_k.sizes(), "attend_cached: the cache must be contiguous fp32 [L, B, Hkv, S, D]");
  const int64_t N = qkv.size(0) * qkv.size(1), H = num_heads, Hkv = num_kv_heads, D = cache_k.size(4), S_max = cache_k.size(3);
  TORCH_CHECK(H % Hkv == 0 && qkv.size(2) == (H + 2 * Hkv) * D, "attend_cached: qkv width does not match the heads");
  TORCH_CHECK(D % 8 == 0 && D <= 512 && H / Hkv <= 8, "attend_cached: head_dim must be a multiple of 8 (<= 512), <= 8 query heads per kv head");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == N * D && sin_signed.numel() == N * D &&
              cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat, "attend_cached: cos / sin must be fp32 [B, T, D]");
  const at::Tensor st = starts.to(at::kLong).contiguous();
  const int64_t B = st.numel();
  const int64_t* sp = st.data_ptr<int64_t>();
  // Each new token i: its row (rb), its index among its row's new tokens (tt) and how many new tokens its row has (tn).
  // Padded: qkv [B, T, F], every row T tokens. Ragged (lengths [B]): qkv [N, 1, F], row b's lengths[b] tokens in a run.
  std::vector<int64_t> rb(N), tt(N), tn(N);
  int64_t width_new = qkv.size(1);  // the tree's row stride: T, or the longest row when ragged
  if (lengths.has_value() && lengths->defined()) {
    const at::Tensor ln = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(ln.numel() == B, "attend_cached: lengths must have one entry per start");
    const int64_t* lp = ln.data_ptr<int64_t>();
    int64_t i = 0;
    width_new = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 1 && i + lp[b] <= N, "attend_cached: lengths must be >= 1 and sum to the new tokens");
      for (int64_t t = 0; t < lp[b]; ++t, ++i) { rb[i] = b; tt[i] = t; tn[i] = lp[b]; }
      width_new = std::max(width_new, lp[b]);
    }
    TORCH_CHECK(i == N, "attend_cached: lengths must sum to the new tokens (", N, "), got ", i);
  } else {
    TORCH_CHECK(qkv.size(0) == B, "attend_cached: starts must have B entries");
    for (int64_t i = 0; i < N; ++i) { rb[i] = i / width_new; tt[i] = i % width_new; tn[i] = width_new; }
  }
  TORCH_CHECK(layer >= 0 && layer < cache_k.size(0) && row0 >= 0 && row0 + B <= cache_k.size(1) && cache_k.size(2) == Hkv, "attend_cached: layer / rows outside the cache");
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(sp[rb[i]] >= 0 && sp[rb[i]] + tn[i] <= S_max, "attend_cached: row ", rb[i], " would write past the cache");
  at::Tensor tree_c;
  if (tree.has_value() && tree->defined()) {
    tree_c = tree->to(at::kBool).contiguous();
    TORCH_CHECK(tree_c.numel() == N * width_new, "attend_cached: tree must be [B, T, T] (ragged: [N, longest row])");
  }
  const bool* tp = tree_c.defined() ? tree_c.data_ptr<bool>() : nullptr;
  const float* qn = q_norm.has_value() && q_norm->defined() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() && k_norm->defined() ? k_norm->data_ptr<float>() : nullptr;
  const float fe = static_cast<float>(eps);

  const int64_t width = (H + 2 * Hkv) * D;
  at::Tensor q = at::empty({N, H, D}, qkv.options());  // rotated queries
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sn = sin_signed.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = cache_k.data_ptr<float>(), *vc = cache_v.data_ptr<float>();
  auto slot = [&](float* base, int64_t b, int64_t g, int64_t s) { return base + (((layer * cache_k.size(1) + row0 + b) * Hkv + g) * S_max + s) * D; };
  float normed[512];  // a head after its q/k norm
  for (int64_t i = 0; i < N; ++i) {
    const int64_t b = rb[i], at_slot = sp[b] + tt[i];
    const float* row = src + i * width;
    const float *c = cp + i * D, *s = sn + i * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* head = row + h * D;
      if (qn) { norm_row(head, qn, fe, normed, D); head = normed; }
      rope_head(head, c, s, qp + (i * H + h) * D, D);
    }
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* head = row + (H + g) * D;
      if (kn) { norm_row(head, kn, fe, normed, D); head = normed; }
      rope_head(head, c, s, slot(kc, b, g, at_slot), D);
      std::memcpy(slot(vc, b, g, at_slot), row + (H + Hkv + g) * D, D * sizeof(float));
    }
  }

  at::Tensor out = at::empty({qkv.size(0), qkv.size(1), H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  int64_t longest = 0;
  for (int64_t i = 0; i < N; ++i) longest = std::max(longest, sp[rb[i]] + tn[i]);
  // The keys token i scores: its row's prefix and, causal, the new tokens up to itself (the keys after it are invisible
  // and would add exact zeros to the softmax sum and to each value sum, so stopping there gives the same bits with less
  // work); with a tree, all of its row's new tokens, masked. A ragged row therefore gets the bits it gets padded or alone.
  auto keys_of = [&](int64_t i) { return tp ? sp[rb[i]] + tn[i] : sp[rb[i]] + tt[i] + 1; };
  // Work items: (new token, kv head), each reading its keys and values once for the group's query heads;
  // too few of them to share among the threads (a single decode stream) and each query head is its own item.
  const int64_t split = N * Hkv < 2 * at::get_num_threads() ? group : 1;
  const int64_t per_item = group / split, items = N * Hkv * split;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, per_item * longest * D));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(per_item * longest);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t part = it % split, g = (it / split) % Hkv, i = it / (split * Hkv);
      const int64_t b = rb[i], prefix = sp[b], head = g * group + part * per_item;
      const bool* allowed = tp ? tp + i * width_new : nullptr;
      const float* next_keys = nullptr;
      int64_t next_S = 0;
      if (it + 1 < i1 && split == 1) {  // the next item's keys, brought toward the core while this one's values are summed
        const int64_t gn = (it + 1) % Hkv, in = (it + 1) / Hkv;
        if (gn != g || rb[in] != b) { next_keys = slot(kc, rb[in], gn, 0); next_S = keys_of(in); }
      }
      kAttendHeads[per_item](qp + (i * H + head) * D, slot(kc, b, g, 0), slot(vc, b, g, 0), keys_of(i), D, scale, prefix,
                             allowed, tt[i], scores.data(), op + (i * H + head) * D, split == 1, next_keys, next_S);
    }
  });
  return out;
}

// The weights of one layer in decode_layers' list, in this order (None where the layer has none: a bias, Qwen3's
// q/k norms, the scales of fp32 weights; int4 weights' scales are [N, groups], bf16 weights' row factors [N]).
enum LayerWeight { kAttnNorm, kQkv, kQkvScale, kQkvBias, kQNorm, kKNorm, kO, kOScale, kMlpNorm, kGateUp, kGateUpScale, kDown, kDownScale, kPerLayer };

const at::Tensor& required(const c10::optional<at::Tensor>& t, const char* what) {
  TORCH_CHECK(t.has_value() && t->defined(), "decode_layers: a layer lacks its ", what);
  return *t;
}

// The layer's GEMM by its weight's kind: group-wise int4 (uint8), bf16, int8 rows (int8 with a scale), fp32.
at::Tensor linear(const at::Tensor& x, const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.has_value() && w->defined(), "decode_layers: a layer lacks a weight");
  if (w->scalar_type() == at::kByte) return tandem_kernels::small_gemm_q4(x, *w, required(scale, "int4 scales"), bias);
  if (w->scalar_type() == at::kBFloat16) return tandem_kernels::small_gemm_bf16(x, *w, required(scale, "bf16 row factors"), bias);
  if (scale.has_value() && scale->defined()) return tandem_kernels::small_gemm_q8(x, *w, *scale, bias);
  return tandem_kernels::small_gemm(x, *w, bias);
}

// Every layer of a cached decode / verify forward in one call: per layer the same ops, in the same order, as
// Block.forward_fused (norm, qkv GEMM, attend_cached, o GEMM, add + norm, gate_up GEMM, silu_mul, down GEMM,
// residual add), so the results are the same bits; what goes is the Python and dispatch between them (~30 x 9
// calls a token). x [B, T, d] the embeddings; weights kPerLayer entries per layer; taps: layers whose outputs to
// return, in that order.
std::tuple<at::Tensor, std::vector<at::Tensor>> decode_layers(
    const at::Tensor& x_in, const c10::List<c10::optional<at::Tensor>>& weights, const at::Tensor& cos, const at::Tensor& sin_signed,
    double eps, at::Tensor cache_k, at::Tensor cache_v, int64_t row0, const at::Tensor& starts, const c10::optional<at::Tensor>& tree,
    int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef taps, const c10::optional<at::Tensor>& lengths) {
  TORCH_CHECK(weights.size() % kPerLayer == 0, "decode_layers: ", kPerLayer, " weights per layer, got ", weights.size());
  const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  for (const int64_t tap : taps) TORCH_CHECK(tap >= 0 && tap < layers, "decode_layers: tap ", tap, " outside the ", layers, " layers");
  const std::vector<c10::optional<at::Tensor>> w(weights.begin(), weights.end());
  std::vector<at::Tensor> tapped(taps.size());
  at::Tensor x = x_in.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    auto W = [&](int i) -> const c10::optional<at::Tensor>& { return w[l * kPerLayer + i]; };
    const at::Tensor h = rms_norm(x, required(W(kAttnNorm), "attention norm"), eps);
    const at::Tensor qkv = linear(h, W(kQkv), W(kQkvScale), W(kQkvBias));
    const at::Tensor attended = attend_cached(qkv, cos, sin_signed, W(kQNorm), W(kKNorm), eps, cache_k, cache_v, l, row0, starts, tree,
                                              num_heads, num_kv_heads, lengths);
    auto [residual, normed] = add_rms_norm(linear(attended, W(kO), W(kOScale), c10::nullopt), x, required(W(kMlpNorm), "MLP norm"), eps);
    const at::Tensor down = linear(silu_mul(linear(normed, W(kGateUp), W(kGateUpScale), c10::nullopt)), W(kDown), W(kDownScale), c10::nullopt);
    x = residual.add_(down);
    for (size_t j = 0; j < taps.size(); ++j)
      if (taps[j] == l) tapped[j] = x;  // never written again: the next layer's add_rms_norm makes a new tensor
  }
  return {x, tapped};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("attend_cached(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor? q_norm, Tensor? k_norm, float eps, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, int layer, int row0, Tensor starts, Tensor? tree, int num_heads, int num_kv_heads, Tensor? lengths=None) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor?[] weights, Tensor cos, Tensor sin_signed, float eps, Tensor(a!) cache_k, Tensor(b!) cache_v, "
        "int row0, Tensor starts, Tensor? tree, int num_heads, int num_kv_heads, int[] taps, Tensor? lengths=None) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("attend_cached", &attend_cached);
  m.impl("decode_layers", &decode_layers);
}
