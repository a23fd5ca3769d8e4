// The mixers of the hybrid decode stack (hybrid_cpu.cpp) for one token: KDA (Kimi-Linear, Kimi K3) and
// absorbed MLA over the latent cache (NoPE: Kimi; RoPE over adjacent pairs: DeepSeek-V3, Kimi K2.5), plus the
// vector helpers they share. Each is the engine's
// op-by-op step (engine/layers/kda.py, engine/layers/mla.py) in fp32; loops are written with AVX2 intrinsics or as plain
// in-order scalar code, so the AVX2 and AVX-512 builds give the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../_cpu/matrix.h"
#include "../_cpu/pool.h"
#include "../_cpu/vec_math.h"
#include "../fp8_cache/cache_rows.h"  // the latent and index caches: fp32, bf16 or fp8, read and written in place
#include "../gqa_decode/gqa_step.h"  // rope: the half-split rotation

namespace localmoe_hybrid {

using localmoe::Matrix;

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = localmoe::hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[j] += s * x[j]
inline void axpy(float s, const float* x, float* y, int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
  for (; j < n; ++j) y[j] += s * x[j];
}

// out = x * rsqrt(mean(x^2) + eps) * w (w null: no weight); out may be x.
inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w ? x[i] * r * w[i] : x[i] * r;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// o[i] <- f(x[i], o[i]) for i < n, 8 lanes at a time (the last n % 8 through a padded copy): with vec_math.h's
// lane-independent functions a value's bits do not depend on where it sits, so the decode step (one token) and the
// prefill chunk (hybrid_prefill.cpp) give a token the same bits.
template <class F>
inline void map_ps(const float* x, float* o, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, f(_mm256_loadu_ps(x + i), _mm256_loadu_ps(o + i)));
  if (i < n) {
    alignas(32) float a[8] = {}, b[8] = {};
    std::memcpy(a, x + i, (n - i) * sizeof(float));
    std::memcpy(b, o + i, (n - i) * sizeof(float));
    _mm256_store_ps(b, f(_mm256_load_ps(a), _mm256_load_ps(b)));
    std::memcpy(o + i, b, (n - i) * sizeof(float));
  }
}

inline __m256 silu_ps(__m256 x) { return _mm256_mul_ps(x, localmoe::sigmoid_ps(x)); }

// ln x for normal x > 0 (Cephes logf, ~1 ulp).
inline __m256 log_ps(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_castsi256_ps(  // x = m 2^e, m in [0.5, 1)
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));
  const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, low));
  m = _mm256_add_ps(_mm256_sub_ps(m, one), _mm256_and_ps(m, low));  // m - 1, or 2 m - 1 below sqrt(1/2)
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 p = _mm256_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                        2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    p = _mm256_fmadd_ps(p, m, _mm256_set1_ps(c));
  p = _mm256_mul_ps(_mm256_mul_ps(p, m), z);
  p = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), p);
  p = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), p);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, p));
}

// softplus(t) = log(1 + e^t) (t itself above 20, as torch): log1p through log(w) u / (w - 1), w = 1 + u.
inline __m256 softplus_ps(__m256 t) {
  const __m256 one = _mm256_set1_ps(1.0f), u = localmoe::exp_ps(t), w = _mm256_add_ps(one, u), d = _mm256_sub_ps(w, one);
  const __m256 exact = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ);  // u below half an ulp of 1: log1p(u) = u
  const __m256 l = _mm256_blendv_ps(_mm256_mul_ps(log_ps(w), _mm256_div_ps(u, d)), u, exact);
  return _mm256_blendv_ps(l, t, _mm256_cmp_ps(t, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
}

// ---- KDA: one token of one layer ----

struct Kda {
  Matrix in_proj;  // rows [q k v (3 H K) | f_a (K) | b (H) | gate (H K full rank, else K)]
  Matrix f_b;      // [H K, K]
  Matrix g_b;      // [H K, K] low-rank gate (Kimi-Linear); rows 0 under K3's full-rank gate
  const float* conv;     // [3 H K, W]
  const float* decay;    // [H] exp(A_log)
  const float* dt_bias;  // [H K]
  const float* o_norm;   // [K]
  float* state;          // [H, K, K] fp32, updated
  float* tail;           // [W-1, 3 H K], updated
  int64_t heads, head_dim, conv_kernel, bounded;
  float lower_bound, eps;
};

// Floats of scratch `kda_step` needs.
inline int64_t kda_scratch(const Kda& a) { return a.in_proj.rows + 3 * a.heads * a.head_dim; }

// The delta rule for one token over value heads [begin, end): value head h reads key head h / group;
// the log-decay is per channel (KDA: g [H K]) or one per head (Gated DeltaNet: g [H]).
struct DeltaHeads {
  const float *q, *k, *v, *g, *beta;
  float *o, *state;
  int64_t K, V, group, scalar_decay;
};

inline void delta_heads(const void* ctx, int64_t begin, int64_t end) {
  const DeltaHeads& c = *static_cast<const DeltaHeads*>(ctx);
  const int64_t K = c.K, V = c.V;
  alignas(32) float a[512], ak[512], aq[512], rk[512], rq[512], u[512];
  for (int64_t h = begin; h < end; ++h) {
    const float *q = c.q + (h / c.group) * K, *k = c.k + (h / c.group) * K, *v = c.v + h * V;
    float* S = c.state + h * K * V;
    float* o = c.o + h * V;
    if (c.scalar_decay) {  // Gated DeltaNet: one decay per head
      const float decay = std::exp(c.g[h]);
      for (int64_t i = 0; i < K; ++i) a[i] = decay;
    } else {
      map_ps(c.g + h * K, a, K, [](__m256 g, __m256) { return localmoe::exp_ps(g); });
    }
    for (int64_t i = 0; i < K; ++i) {
      ak[i] = k[i] * a[i];
      aq[i] = q[i] * a[i];
    }
    std::memset(rk, 0, V * sizeof(float));
    std::memset(rq, 0, V * sizeof(float));
    for (int64_t i = 0; i < K; ++i) {  // decayed S^T k and S^T q
      axpy(ak[i], S + i * V, rk, V);
      axpy(aq[i], S + i * V, rq, V);
    }
    const float qk = dot(q, k, K), beta = c.beta[h];
    for (int64_t j = 0; j < V; ++j) {
      u[j] = beta * (v[j] - rk[j]);
      o[j] = rq[j] + qk * u[j];
    }
    for (int64_t i = 0; i < K; ++i) {  // S <- diag(exp(g)) S + k u^T
      const __m256 ai = _mm256_set1_ps(a[i]), ki = _mm256_set1_ps(k[i]);
      float* row = S + i * V;
      int64_t j = 0;
      for (; j + 8 <= V; j += 8)
        _mm256_storeu_ps(row + j, _mm256_fmadd_ps(ki, _mm256_loadu_ps(u + j), _mm256_mul_ps(ai, _mm256_loadu_ps(row + j))));
      for (; j < V; ++j) row[j] = k[i] * u[j] + a[i] * row[j];
    }
  }
}

// Depthwise causal conv of y [C] over the tail [W-1, C] (W >= 2; the tail shifts by one), then SiLU.
inline void conv_silu(float* y, const float* conv, float* tail, int64_t C, int64_t W) {
  for (int64_t c = 0; c < C; ++c) {
    const float* w = conv + c * W;
    float s = tail[c] * w[0];
    for (int64_t j = 1; j < W - 1; ++j) s = s + tail[j * C + c] * w[j];
    s = s + y[c] * w[W - 1];
    for (int64_t j = 0; j + 1 < W - 1; ++j) tail[j * C + c] = tail[(j + 1) * C + c];
    tail[(W - 2) * C + c] = y[c];
    y[c] = s;
  }
  map_ps(y, y, C, [](__m256 s, __m256) { return silu_ps(s); });
}

// q, k [heads, K] <- l2norm (eps inside the root); q scaled by K^-0.5.
inline void qk_l2norm(float* q, float* k, int64_t heads, int64_t K) {
  const float sq = 1.0f / std::sqrt(static_cast<float>(K));
  for (int64_t h = 0; h < heads; ++h) {
    const float rq = 1.0f / std::sqrt(dot(q + h * K, q + h * K, K) + 1e-6f);
    const float rk = 1.0f / std::sqrt(dot(k + h * K, k + h * K, K) + 1e-6f);
    for (int64_t i = 0; i < K; ++i) {
      q[h * K + i] = q[h * K + i] * rq * sq;
      k[h * K + i] = k[h * K + i] * rk;
    }
  }
}

// One token of KDA between its projections, before the delta rule: y [in_proj.rows]'s q, k, v (already through
// the conv + SiLU: `conv_silu`) -> q, k l2-normed, q scaled; f [H K] (f_b's output) -> the log-decay g; beta [H].
inline void kda_gates(const Kda& a, float* y, float* f, float* beta) {
  const int64_t H = a.heads, K = a.head_dim, C = 3 * H * K;
  qk_l2norm(y, y + H * K, H, K);
  const __m256 bound = _mm256_set1_ps(a.lower_bound);
  for (int64_t h = 0; h < H; ++h) {
    const __m256 d = _mm256_set1_ps(a.decay[h]), neg = _mm256_set1_ps(-a.decay[h]);
    float* fh = f + h * K;
    map_ps(a.dt_bias + h * K, fh, K, [&](__m256 b, __m256 x) {
      const __m256 t = _mm256_add_ps(x, b);
      return a.bounded ? _mm256_mul_ps(bound, localmoe::sigmoid_ps(_mm256_mul_ps(d, t)))
                       : _mm256_mul_ps(neg, softplus_ps(t));
    });
  }
  map_ps(y + C + K, beta, H, [](__m256 b, __m256) { return localmoe::sigmoid_ps(b); });
}

// o [H K] (the delta rule's) <- RMSNorm per head (o_norm) * sigmoid(gate [H K]): the o_proj input.
inline void kda_out(const Kda& a, float* o, const float* gate) {
  const int64_t H = a.heads, K = a.head_dim;
  for (int64_t h = 0; h < H; ++h) {
    rms_norm(o + h * K, a.o_norm, K, a.eps, o + h * K);
    map_ps(gate + h * K, o + h * K, K, [](__m256 g, __m256 x) { return _mm256_mul_ps(x, localmoe::sigmoid_ps(g)); });
  }
}

// x [D] (normed) -> o [H K] (before o_proj), the state and conv tail advanced by one token.
inline void kda_step(const Kda& a, const float* x, float* o, float* scratch, void* xq, int threads) {
  const int64_t H = a.heads, K = a.head_dim, C = 3 * H * K, W = a.conv_kernel;
  float* y = scratch;  // in_proj output
  float* f = y + a.in_proj.rows;
  float* gate = f + H * K;
  float* beta = gate + H * K;
  localmoe::matvec(a.in_proj, x, y, xq, threads);
  localmoe::matvec(a.f_b, y + C, f, xq, threads);  // f_b(f_a x) [H K]: the log-decay
  const float* g_in = y + C + K + H;
  if (a.g_b.rows) {
    localmoe::matvec(a.g_b, g_in, gate, xq, threads);
  } else {
    std::memcpy(gate, g_in, H * K * sizeof(float));
  }
  conv_silu(y, a.conv, a.tail, C, W);
  kda_gates(a, y, f, beta);
  DeltaHeads ctx{y, y + H * K, y + 2 * H * K, f, beta, o, a.state, K, K, 1, 0};
  localmoe::parallel(delta_heads, &ctx, H, 1, threads);
  kda_out(a, o, gate);
}

// ---- Gated DeltaNet (Qwen3-Next): one token of one layer ----

struct Gdn {
  Matrix in_proj;        // rows [q (Hk K) | k (Hk K) | v (Hv V) | z (Hv V) | b (Hv) | a (Hv)]
  const float* conv;     // [C, W], C = 2 Hk K + Hv V
  const float* decay;    // [Hv] exp(A_log)
  const float* dt_bias;  // [Hv]
  const float* norm;     // [V]
  float* state;          // [Hv, K, V] fp32, updated
  float* tail;           // [W-1, C], updated
  int64_t key_heads, value_heads, key_dim, value_dim, conv_kernel;
  float eps;
};

inline int64_t gdn_scratch(const Gdn& a) { return a.in_proj.rows + 2 * a.value_heads; }

inline int64_t gdn_channels(const Gdn& a) { return 2 * a.key_heads * a.key_dim + a.value_heads * a.value_dim; }

// One token of Gated DeltaNet between its projections, before the delta rule: y [in_proj.rows]'s q, k, v (already
// through the conv + SiLU) -> q, k l2-normed, q scaled; g, beta [Hv] from y's a and b.
inline void gdn_gates(const Gdn& a, float* y, float* g, float* beta) {
  const int64_t Hk = a.key_heads, Hv = a.value_heads, K = a.key_dim, V = a.value_dim, C = gdn_channels(a);
  qk_l2norm(y, y + Hk * K, Hk, K);
  const float *b = y + C + Hv * V, *al = b + Hv;
  map_ps(al, g, Hv, [](__m256 x, __m256) { return x; });
  map_ps(a.dt_bias, g, Hv, [](__m256 d, __m256 x) { return softplus_ps(_mm256_add_ps(x, d)); });
  for (int64_t h = 0; h < Hv; ++h) g[h] = -a.decay[h] * g[h];
  map_ps(b, beta, Hv, [](__m256 x, __m256) { return localmoe::sigmoid_ps(x); });
}

// o [Hv V] (the delta rule's) <- the gated RMSNorm norm(o) * silu(z [Hv V]): the out_proj input.
inline void gdn_out(const Gdn& a, float* o, const float* z) {
  const int64_t Hv = a.value_heads, V = a.value_dim;
  for (int64_t h = 0; h < Hv; ++h) {
    rms_norm(o + h * V, a.norm, V, a.eps, o + h * V);
    map_ps(z + h * V, o + h * V, V, [](__m256 z, __m256 x) { return _mm256_mul_ps(x, silu_ps(z)); });
  }
}

// x [D] (normed) -> o [Hv V] (before out_proj), the state and conv tail advanced by one token.
inline void gdn_step(const Gdn& a, const float* x, float* o, float* scratch, void* xq, int threads) {
  const int64_t Hk = a.key_heads, Hv = a.value_heads, K = a.key_dim, V = a.value_dim, C = gdn_channels(a);
  float* y = scratch;
  float* g = y + a.in_proj.rows;
  float* beta = g + Hv;
  localmoe::matvec(a.in_proj, x, y, xq, threads);
  conv_silu(y, a.conv, a.tail, C, a.conv_kernel);
  gdn_gates(a, y, g, beta);
  DeltaHeads ctx{y, y + Hk * K, y + 2 * Hk * K, g, beta, o, a.state, K, V, Hv / Hk, 1};
  localmoe::parallel(delta_heads, &ctx, Hv, 1, threads);
  gdn_out(a, o, y + C);
}

// ---- MLA, absorbed (NoPE: Kimi; RoPE: DeepSeek): one token of one layer ----

// DSA's token selection for an MLA layer (engine/layers/indexer.py, kpool_indexer.py, dsa_shared.py).
struct Indexer {
  Matrix wq_b;     // [Hi Di, q_rank]: index queries from the q LoRA output
  Matrix wk;       // [Di, D]: the token's index key, then LayerNorm (k_norm_w, k_norm_b, eps 1e-6)
  Matrix weights;  // [Hi, D]: head weights (times weight_scale)
  Matrix gate;     // [Di, D] k-pool gate logits (GLM-5-Next); rows 0: keys scored per token (DeepSeek)
  const float* k_norm_w;
  const float* k_norm_b;
  const float* ape;  // [pool, Di] (k-pool)
  localmoe_cache::CacheRows keys;  // the index cache: per token the key (k-pool: then the gate logits) in blocks
  int64_t select;    // 0: plain MLA; 1: this layer's indexer selects; 2: the latest selecting layer's rows (dsa_shared)
  int64_t heads, head_dim, rope_dim, interleaved, top_k, pool, tail;
  int64_t dense_context;  // up to this many cached tokens nothing is dropped: attend to all
  float weight_scale;
  float* pooled;         // k-pool: the keys of the complete pools [pooled_done, Di] so far (they never change)
  int64_t* pooled_done;  // how many `pooled` holds; the engine lowers it when the cache is trimmed
};

// The rows a selecting layer chose for this token, for itself and the dsa_shared layers after it.
struct Selection {
  int64_t* rows;  // increasing cache positions
  int64_t count;
  int64_t valid;  // 0: the latest selecting layer attended to every row (nothing chosen)
};

struct Mla {
  Matrix q_a;   // [q_rank, D]; rows 0: no q LoRA (q_b is q_proj)
  Matrix q_b;   // [H (nope + rope), q_rank | D]
  Matrix kv_a;  // [r + rope, D]
  Matrix g;     // [H v, D] output gate; rows 0: none
  const float* q_a_norm;
  const float* kv_a_norm;
  const float* w_uk;  // [H, nope, r]
  const float* w_uv;  // [H, v, r]
  localmoe_cache::CacheRows rows;  // the latent cache, one "head" of r + rope values; this token's row written at pos
  int64_t heads, kv_rank, nope, rope, vdim;
  int64_t rotate;  // 1: RoPE over adjacent pairs of the rope part, kept de-interleaved (DeepSeek); 0: NoPE
  float scale, eps;
  Indexer dsa;  // select 0: plain MLA over every cached row
};

// x [n] (pairs adjacent) <- RoPE over adjacent pairs in de-interleaved order (evens, then odds), as
// engine/layers/mla.py `rotate_interleaved`: the half-split rotation by cos / signed sin [n] after the shuffle.
inline void rotate_pairs(float* x, int64_t n, const float* cos, const float* ssin) {
  alignas(32) float t[128];
  const int64_t half = n / 2;
  for (int64_t i = 0; i < half; ++i) t[i] = x[2 * i], t[half + i] = x[2 * i + 1];
  for (int64_t i = 0; i < half; ++i) {
    const float a = t[i], b = t[i + half];
    x[i] = a * cos[i] + b * ssin[i];
    x[i + half] = b * cos[i + half] + a * ssin[i + half];
  }
}

// The index cache's values per token: the key, then (k-pool) its gate logits.
inline int64_t index_width(const Indexer& ix) { return ix.head_dim * (ix.gate.rows ? 2 : 1); }

inline int64_t mla_scratch(const Mla& m) {
  const int64_t index = m.dsa.select == 1 ? m.dsa.heads * m.dsa.head_dim + m.dsa.heads + index_width(m.dsa) : 0;
  return m.q_a.rows + m.q_b.rows + m.g.rows + m.heads * m.vdim + m.kv_rank + m.rope + index;
}

// out[0 .. min(k, n)) <- the indices of the k best of s[0 .. n) in increasing order; returns their count.
// Tie rule (kernels/topk_select `top_columns`): a higher score first, of equal scores the lower index.
inline int64_t top_rows(const float* s, int64_t n, int64_t k, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = i;
  if (k < n) {
    std::nth_element(out, out + k, out + n, [s](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    std::sort(out, out + k);
    return k;
  }
  return n;
}

// Token s's index-cache values as fp32 [index_width] in one piece (the cache's blocks side by side), of a
// cache holding `length` positions: a pointer into the cache where one block holds them, else `buf`.
inline const float* index_row(const Indexer& ix, int64_t s, int64_t length, float* buf) {
  const localmoe_cache::CacheRows& c = ix.keys;
  if (c.heads == 1) return localmoe_cache::row(c, 0, s, length, buf);
  for (int64_t h = 0; h < c.heads; ++h) {
    const float* r = localmoe_cache::row(c, h, s, length, buf + h * c.dim);
    if (r != buf + h * c.dim) std::memcpy(buf + h * c.dim, r, c.dim * sizeof(float));
  }
  return buf;
}

struct IndexScores {
  const Indexer* ix;
  const float* q;       // [Hi, Di]
  const float* w;       // [Hi], scaled
  const float* pooled;  // k-pool: the pools' keys [J, Di]; null: token j's key from the cache
  int64_t length;       // positions cached
  float* out;
};

// out[j] = sum_h w[h] relu(q[h] . key_j), in head order (engine/layers/indexer.py `select`)
inline void index_scores(const void* ctx, int64_t begin, int64_t end) {
  const IndexScores& c = *static_cast<const IndexScores*>(ctx);
  const int64_t H = c.ix->heads, Di = c.ix->head_dim;
  thread_local std::vector<float> buf;
  buf.resize(index_width(*c.ix));
  for (int64_t j = begin; j < end; ++j) {
    const float* k = c.pooled ? c.pooled + j * Di : index_row(*c.ix, j, c.length, buf.data());
    float total = 0.0f;
    for (int64_t h = 0; h < H; ++h) total += c.w[h] * std::max(0.0f, dot(c.q + h * Di, k, Di));
    c.out[j] = total;
  }
}

// The token's index key (and k-pool gate logits) written at `pos`: LayerNorm(wk x), its first rope_dim
// dims rotated (half-split, or adjacent pairs de-interleaved as the MLA rope part); k: [index_width] scratch.
inline void index_key_step(const Indexer& ix, const float* x, int64_t pos, const float* cos, const float* ssin,
                           float* k, void* xq, int threads) {
  const int64_t Di = ix.head_dim;
  localmoe::matvec(ix.wk, x, k, xq, threads);
  float mean = 0.0f, var = 0.0f;
  for (int64_t i = 0; i < Di; ++i) mean += k[i];
  mean /= static_cast<float>(Di);
  for (int64_t i = 0; i < Di; ++i) var += (k[i] - mean) * (k[i] - mean);
  const float r = 1.0f / std::sqrt(var / static_cast<float>(Di) + 1e-6f);
  for (int64_t i = 0; i < Di; ++i) k[i] = (k[i] - mean) * r * ix.k_norm_w[i] + ix.k_norm_b[i];
  if (ix.rope_dim) (ix.interleaved ? rotate_pairs : localmoe_gqa::rope)(k, ix.rope_dim, cos, ssin);
  if (ix.gate.rows) localmoe::matvec(ix.gate, x, k + Di, xq, threads);
  localmoe_cache::write(ix.keys, pos, k);
}

// k-pool: the keys of pools [*pooled_done, J) into `pooled` (pool j holds tokens j P .. j P + P - 1; its key
// is the per-channel softmax(gate + ape) mean of their keys), over a cache of `length` positions.
inline void pool_keys(const Indexer& ix, int64_t J, int64_t length) {
  const int64_t P = ix.pool, Di = ix.head_dim, width = index_width(ix);
  thread_local std::vector<float> buf;
  thread_local std::vector<const float*> member;
  buf.resize(P * width);
  member.resize(P);
  for (int64_t j = *ix.pooled_done; j < J; ++j) {
    for (int64_t i = 0; i < P; ++i) member[i] = index_row(ix, j * P + i, length, buf.data() + i * width);
    float* K = ix.pooled + j * Di;
    for (int64_t d = 0; d < Di; ++d) {
      float mx = -INFINITY, total = 0.0f, acc = 0.0f;
      for (int64_t i = 0; i < P; ++i) mx = std::max(mx, member[i][Di + d] + ix.ape[i * Di + d]);
      for (int64_t i = 0; i < P; ++i) total += std::exp(member[i][Di + d] + ix.ape[i * Di + d] - mx);
      for (int64_t i = 0; i < P; ++i) acc += std::exp(member[i][Di + d] + ix.ape[i * Di + d] - mx) / total * member[i][d];
      K[d] = acc;
    }
  }
  *ix.pooled_done = std::max(*ix.pooled_done, J);
}

// The rows query `pos` attends to (S = pos + 1 cached tokens, more than dense_context): the index queries
// from the q LoRA output cq, head weights from x, scores over the tokens (or complete pools) and the top-k.
inline void index_select(const Indexer& ix, const float* x, const float* cq, int64_t pos, const float* cos,
                         const float* ssin, float* scratch, Selection& sel, void* xq, int threads) {
  const int64_t H = ix.heads, Di = ix.head_dim, S = pos + 1;
  float* q = scratch;
  float* w = q + H * Di;
  localmoe::matvec(ix.wq_b, cq, q, xq, threads);
  if (ix.rope_dim)
    for (int64_t h = 0; h < H; ++h) (ix.interleaved ? rotate_pairs : localmoe_gqa::rope)(q + h * Di, ix.rope_dim, cos, ssin);
  localmoe::matvec(ix.weights, x, w, xq, threads);
  for (int64_t h = 0; h < H; ++h) w[h] *= ix.weight_scale;
  thread_local std::vector<float> scores;
  thread_local std::vector<int64_t> order;
  if (!ix.gate.rows) {  // one key per token (DeepSeek-V3.2's lightning indexer)
    scores.resize(S);
    order.resize(S);
    IndexScores ctx{&ix, q, w, nullptr, S, scores.data()};
    localmoe::parallel(index_scores, &ctx, S, 256, threads);
    sel.count = top_rows(scores.data(), S, ix.top_k, order.data());
    std::copy(order.begin(), order.begin() + sel.count, sel.rows);
    sel.valid = 1;
    return;
  }
  const int64_t P = ix.pool, J = S / P;  // the complete pools; their keys are kept
  pool_keys(ix, J, S);
  scores.resize(J);
  order.resize(J);
  IndexScores ctx{&ix, q, w, ix.pooled, S, scores.data()};
  localmoe::parallel(index_scores, &ctx, J, 64, threads);
  const int64_t k = top_rows(scores.data(), J, ix.top_k / P, order.data());
  int64_t n = 0;
  for (int64_t c = 0; c < k; ++c)
    for (int64_t i = 0; i < P; ++i) sel.rows[n++] = order[c] * P + i;
  if (ix.tail && P > 1)  // the query's own incomplete pool
    for (int64_t t = S - S % P; t < S; ++t) sel.rows[n++] = t;
  sel.count = n;
  sel.valid = 1;
}

// NQ query heads' online softmax over one block of n keys (decode: one; hybrid_prefill.cpp `mla_chunk`: 8 queries of
// a chunk): p [NQ, 64] their scaled scores, query u seeing the block's first seen[u] keys (0: the block is past it);
// rows[s] the keys' latent rows (their first r values the values); o [NQ, r] (not yet divided by l), mx, l [NQ]
// updated. Per query: its new maximum, o and l scaled by exp(old - new) where that is not 1, then per value lane
// o += e_s row_s over the keys in order (one FMA each: axpy's lanes) and l += e_s. A key past a query's seen count
// gets e = 0 there (an exact no-op on finite rows), so the 8 queries share each row load.
template <int NQ>
inline void softmax_block(const float* p, const int64_t* seen, int64_t n, const float* const* rows, int64_t r,
                          float* mx, float* l, float* o) {
  alignas(32) float e[NQ][64];
  float corr[NQ];
  for (int u = 0; u < NQ; ++u) {
    corr[u] = 1.0f;
    const int64_t k = std::max<int64_t>(0, seen[u]);
    if (k > 0) {
      float bm = -INFINITY;
      for (int64_t s = 0; s < k; ++s) bm = std::max(bm, p[u * 64 + s]);
      const float nm = std::max(mx[u], bm);
      corr[u] = std::exp(mx[u] - nm);
      l[u] *= corr[u];
      for (int64_t s = 0; s < k; ++s) {
        e[u][s] = std::exp(p[u * 64 + s] - nm);
        l[u] += e[u][s];
      }
      mx[u] = nm;
    }
    for (int64_t s = k; s < n; ++s) e[u][s] = 0.0f;
  }
  int64_t j = 0;
  for (; j + 8 <= r; j += 8) {
    __m256 acc[NQ];
    for (int u = 0; u < NQ; ++u) {
      acc[u] = _mm256_loadu_ps(o + u * r + j);
      if (corr[u] != 1.0f) acc[u] = _mm256_mul_ps(acc[u], _mm256_set1_ps(corr[u]));
    }
    for (int64_t s = 0; s < n; ++s) {
      const __m256 x = _mm256_loadu_ps(rows[s] + j);
      for (int u = 0; u < NQ; ++u) acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(e[u][s]), x, acc[u]);
    }
    for (int u = 0; u < NQ; ++u) _mm256_storeu_ps(o + u * r + j, acc[u]);
  }
  for (int u = 0; u < NQ; ++u)
    for (int64_t k = j; k < r; ++k) {
      float y = o[u * r + k];
      if (corr[u] != 1.0f) y *= corr[u];
      for (int64_t s = 0; s < n; ++s) y += e[u][s] * rows[s][k];
      o[u * r + k] = y;
    }
}

struct MlaHeads {
  const Mla* m;
  const float* q;  // [H, nope + rope]
  float* out;      // [H, v]
  int64_t length;  // rows attended: pos + 1, or the count of `picks`
  const int64_t* picks;  // the rows attended (increasing), or null: rows 0 .. length - 1
  int64_t cached;  // positions in the cache (pos + 1)
  int64_t groups;  // the heads in this many contiguous groups
};

// Heads of groups [begin, end): each group walks the rows 64 at a time (a bf16 / fp8 block dequantised once
// for all its heads), every head's online softmax in the same order as one head alone.
inline void mla_heads(const void* ctx, int64_t begin, int64_t end) {
  const MlaHeads& c = *static_cast<const MlaHeads*>(ctx);
  const Mla& m = *c.m;
  const int64_t r = m.kv_rank, R = r + m.rope, qd = m.nope + m.rope, H = m.heads;
  const int64_t h0 = begin * H / c.groups, h1 = end * H / c.groups, nh = h1 - h0;
  thread_local std::vector<float> qa, acc, block, mx, l;
  qa.resize(nh * R);
  acc.resize(nh * r);
  block.resize(64 * R);
  mx.assign(nh, -INFINITY);
  l.assign(nh, 0.0f);
  alignas(32) float p[64];
  const float* rows[64];
  for (int64_t h = h0; h < h1; ++h) {
    const float* q = c.q + h * qd;
    float* a = qa.data() + (h - h0) * R;
    std::memset(a, 0, r * sizeof(float));
    for (int64_t n = 0; n < m.nope; ++n) axpy(q[n], m.w_uk + (h * m.nope + n) * r, a, r);  // W_uk^T q_nope
    std::memcpy(a + r, q + m.nope, m.rope * sizeof(float));
    std::memset(acc.data() + (h - h0) * r, 0, r * sizeof(float));
  }
  for (int64_t s0 = 0; s0 < c.length; s0 += 64) {  // online softmax, 64 keys at a time
    const int64_t n = std::min<int64_t>(64, c.length - s0);
    for (int64_t s = 0; s < n; ++s)
      rows[s] = localmoe_cache::row(m.rows, 0, c.picks ? c.picks[s0 + s] : s0 + s, c.cached, block.data() + s * R);
    for (int64_t i = 0; i < nh; ++i) {
      const float* a = qa.data() + i * R;
      for (int64_t s = 0; s < n; ++s) p[s] = dot(a, rows[s], R) * m.scale;
      softmax_block<1>(p, &n, n, rows, r, &mx[i], &l[i], acc.data() + i * r);
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    float* o = acc.data() + (h - h0) * r;
    const float inv = 1.0f / l[h - h0];
    for (int64_t i = 0; i < r; ++i) o[i] *= inv;
    for (int64_t v = 0; v < m.vdim; ++v) c.out[h * m.vdim + v] = dot(m.w_uv + (h * m.vdim + v) * r, o, r);
  }
}

// x [D] (normed) -> o [H v] (gated, before o_proj); the token's latent row written at `pos`; cos / ssin: the
// RoPE tables [rope] at the token's rotary position (read only where m.rotate or the indexer rotates). A DSA
// layer (m.dsa.select) also writes its index key and, past dense_context cached tokens, attends only to the
// rows its indexer (or, dsa_shared, the latest selecting layer) chose: `sel`.
inline void mla_step(const Mla& m, const float* x, int64_t pos, const float* cos, const float* ssin, float* o,
                     float* scratch, Selection& sel, void* xq, int threads) {
  float* cq = scratch;
  float* q = cq + m.q_a.rows;
  float* gate = q + m.q_b.rows;
  float* row = gate + m.g.rows + m.heads * m.vdim;
  float* index = row + m.kv_rank + m.rope;
  const float* qin = x;
  if (m.q_a.rows) {
    localmoe::matvec(m.q_a, x, cq, xq, threads);
    rms_norm(cq, m.q_a_norm, m.q_a.rows, m.eps, cq);
    qin = cq;
  }
  localmoe::matvec(m.q_b, qin, q, xq, threads);
  localmoe::matvec(m.kv_a, x, row, xq, threads);
  rms_norm(row, m.kv_a_norm, m.kv_rank, m.eps, row);
  if (m.rotate) {
    const int64_t qd = m.nope + m.rope;
    for (int64_t h = 0; h < m.heads; ++h) rotate_pairs(q + h * qd + m.nope, m.rope, cos, ssin);
    rotate_pairs(row + m.kv_rank, m.rope, cos, ssin);
  }
  localmoe_cache::write(m.rows, pos, row);
  const Indexer& ix = m.dsa;
  bool sparse = ix.select && pos + 1 > ix.dense_context;
  if (ix.select == 1) {
    index_key_step(ix, x, pos, cos, ssin, index + ix.heads * ix.head_dim + ix.heads, xq, threads);
    sel.valid = 0;
    if (sparse) index_select(ix, x, cq, pos, cos, ssin, index, sel, xq, threads);
  }
  sparse = sparse && sel.valid;  // dsa_shared: the plan puts a selecting layer with the same context before it
  const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(threads, m.heads));
  MlaHeads ctx{&m, q, o, sparse ? sel.count : pos + 1, sparse ? sel.rows : nullptr, pos + 1, groups};
  localmoe::parallel(mla_heads, &ctx, groups, 1, threads);
  if (m.g.rows) {
    localmoe::matvec(m.g, x, gate, xq, threads);
    for (int64_t i = 0; i < m.heads * m.vdim; ++i) o[i] *= sigmoid(gate[i]);
  }
}

}  // namespace localmoe_hybrid
