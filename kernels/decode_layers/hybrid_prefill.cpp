// The prompt-chunk (prefill) entries of the delta-rule mixers: KDA (Kimi-Linear, Kimi K3) and Gated DeltaNet
// (Qwen3-Next) between their projections, one call per layer for a chunk of T tokens of B rows, with the fused decode
// step's per-token arithmetic (hybrid_mixers.h): the conv + SiLU over the tail, q / k l2norm, the gates, the delta
// rule and the output norm * gate give every token the bits the decode step gives it from the same projections, so a
// token's bits do not depend on the chunk it comes in or on the thread count. The engine's prefill paths
// (engine/layers/kda.py, gated_deltanet.py) call them through kernels/kda/native.py; `delta_rule_tokens` is the
// delta rule alone (the op-by-op form's). `mla_chunk`: absorbed MLA attention over the latent rows for a chunk (Kimi-Linear,
// Kimi K3), each query with the decode step's online softmax (`softmax_block`, 64 keys a block from key 0).
//   conv:   per channel, the T tokens in order over the conv tail (a channel's window held in registers)
//   gates:  per token (l2norm, log-decay, beta)
//   delta:  per (row, value head), the T tokens in order, its state [K, V] in L1 / L2 over the chunk
//   output: per token
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hybrid_mixers.h"

namespace {

// The delta rule over T tokens of B rows: per (row, value head) task its tokens in order through `delta_heads`.
// Token t of row b reads q, k at q + (b T + t) qk_stride (key head h / group), v at v + (b T + t) v_stride, g at
// g + (b T + t) g_stride (H K per channel, or H: scalar_decay), beta at beta + (b T + t) H; writes o [B, T, H, V].
struct DeltaTokens {
  const float *q, *k, *v, *g, *beta;
  float *o, *state;
  int64_t T, H, K, V, group, scalar_decay, qk_stride, v_stride, g_stride;
};

void delta_tokens(const void* ctx, int64_t i0, int64_t i1) {
  const DeltaTokens& c = *static_cast<const DeltaTokens*>(ctx);
  const int64_t H = c.H, K = c.K, V = c.V;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / H, h = i % H;
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t bt = b * c.T + t;
      const localmoe_hybrid::DeltaHeads one{c.q + bt * c.qk_stride, c.k + bt * c.qk_stride, c.v + bt * c.v_stride,
                                            c.g + bt * c.g_stride, c.beta + bt * H, c.o + bt * H * V,
                                            c.state + b * H * K * V, K, V, c.group, c.scalar_decay};
      localmoe_hybrid::delta_heads(&one, h, h + 1);
    }
  }
}

// The depthwise causal conv of channels [c0, c1) (multiples of 8 but the last) over T tokens of one row: y [T, stride]
// (the first C values of each token) in place, tail [W-1, C] advanced by T tokens; per (token, channel) `conv_silu`'s
// products and sums in its order, 8 channels at a time, their windows in registers. wT [W, C]: the weights transposed.
struct ConvTokens {
  float* y;
  const float* wT;
  float* tail;
  int64_t stride, T, C, W;
};

void conv_tokens(const void* ctx, int64_t c0, int64_t c1) {
  const ConvTokens& a = *static_cast<const ConvTokens*>(ctx);
  const int64_t W = a.W, C = a.C;
  for (int64_t c = c0; c < c1; c += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - c);
    alignas(32) float lanes[17][8] = {};  // a short last block: through padded copies, the same arithmetic
    __m256 win[16], w[17];
    for (int64_t j = 0; j < W; ++j) {
      std::memcpy(lanes[j], a.wT + j * C + c, n * sizeof(float));
      w[j] = _mm256_load_ps(lanes[j]);
    }
    for (int64_t j = 0; j < W - 1; ++j) {
      std::memcpy(lanes[j], a.tail + j * C + c, n * sizeof(float));
      win[j] = _mm256_load_ps(lanes[j]);
    }
    for (int64_t t = 0; t < a.T; ++t) {
      float* y = a.y + t * a.stride + c;
      __m256 x;
      if (n == 8) {
        x = _mm256_loadu_ps(y);
      } else {
        std::memcpy(lanes[0], y, n * sizeof(float));
        x = _mm256_load_ps(lanes[0]);
      }
      __m256 s = _mm256_mul_ps(win[0], w[0]);
      for (int64_t j = 1; j < W - 1; ++j) s = _mm256_add_ps(s, _mm256_mul_ps(win[j], w[j]));
      s = _mm256_add_ps(s, _mm256_mul_ps(x, w[W - 1]));
      for (int64_t j = 0; j + 1 < W - 1; ++j) win[j] = win[j + 1];
      win[W - 2] = x;
      if (n == 8) {
        _mm256_storeu_ps(y, s);
      } else {
        _mm256_store_ps(lanes[0], s);
        std::memcpy(y, lanes[0], n * sizeof(float));
      }
    }
    for (int64_t j = 0; j < W - 1; ++j) {
      _mm256_store_ps(lanes[j], win[j]);
      std::memcpy(a.tail + j * C + c, lanes[j], n * sizeof(float));
    }
  }
}

struct SiluTokens {
  float* y;
  int64_t stride, C;
};

void silu_tokens(const void* ctx, int64_t n0, int64_t n1) {
  const SiluTokens& a = *static_cast<const SiluTokens*>(ctx);
  for (int64_t n = n0; n < n1; ++n)
    localmoe_hybrid::map_ps(a.y + n * a.stride, a.y + n * a.stride, a.C,
                            [](__m256 s, __m256) { return localmoe_hybrid::silu_ps(s); });
}

// The conv + SiLU of B rows of T tokens (conv [C, W]).
void conv_rows(float* y, int64_t stride, int64_t B, int64_t T, const float* conv, float* tail, int64_t C, int64_t W,
               int threads) {
  std::vector<float> wT(W * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < W; ++j) wT[j * C + c] = conv[c * W + j];
  for (int64_t b = 0; b < B; ++b) {
    const ConvTokens ctx{y + b * T * stride, wT.data(), tail + b * (W - 1) * C, stride, T, C, W};
    localmoe::parallel(conv_tokens, &ctx, C, 64, threads);  // chunks of 64 channels: blocks of 8 stay whole
  }
  const SiluTokens silu{y, stride, C};
  localmoe::parallel(silu_tokens, &silu, B * T, 8, threads);
}

// Padding (valid[b T + t] == 0: a left-padded row's token) neither decays nor writes the state, as the op-by-op
// form's g * valid, beta * valid.
void mask(const float* valid, int64_t N, float* g, int64_t g_width, float* beta, int64_t H) {
  if (valid == nullptr) return;
  for (int64_t n = 0; n < N; ++n)
    if (valid[n] == 0.0f) {
      std::memset(g + n * g_width, 0, g_width * sizeof(float));
      std::memset(beta + n * H, 0, H * sizeof(float));
    }
}

struct KdaTokens {
  const localmoe_hybrid::Kda* a;
  float *y, *f, *beta, *o;
  const float* gate;
  int64_t stride, gate_stride;
  int out;  // 0: kda_gates, 1: kda_out
};

void kda_tokens(const void* ctx, int64_t n0, int64_t n1) {
  const KdaTokens& c = *static_cast<const KdaTokens*>(ctx);
  const int64_t HK = c.a->heads * c.a->head_dim;
  for (int64_t n = n0; n < n1; ++n)
    if (c.out)
      localmoe_hybrid::kda_out(*c.a, c.o + n * HK, c.gate + n * c.gate_stride);
    else
      localmoe_hybrid::kda_gates(*c.a, c.y + n * c.stride, c.f + n * HK, c.beta + n * c.a->heads);
}

struct GdnTokens {
  const localmoe_hybrid::Gdn* a;
  float *y, *g, *beta, *o;
  int64_t stride;
  int out;  // 0: gdn_gates, 1: gdn_out
};

void gdn_tokens(const void* ctx, int64_t n0, int64_t n1) {
  const GdnTokens& c = *static_cast<const GdnTokens*>(ctx);
  const int64_t Hv = c.a->value_heads, C = localmoe_hybrid::gdn_channels(*c.a);
  for (int64_t n = n0; n < n1; ++n)
    if (c.out)
      localmoe_hybrid::gdn_out(*c.a, c.o + n * Hv * c.a->value_dim, c.y + n * c.stride + C);
    else
      localmoe_hybrid::gdn_gates(*c.a, c.y + n * c.stride, c.g + n * Hv, c.beta + n * Hv);
}

// out[u] = dot(a + u a_step, b + u b_step, n) for u < 8: `dot`'s arithmetic for each (the 8 sums interleaved, so
// their FMA chains overlap; a step of 0 shares an operand).
inline void dots8(const float* a, int64_t a_step, const float* b, int64_t b_step, int64_t n, float* out) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + u * a_step + i), _mm256_loadu_ps(b + u * b_step + i), acc[u]);
  localmoe::hsum8(acc, out);
  for (int u = 0; u < 8; ++u)
    for (int64_t j = i; j < n; ++j) out[u] += a[u * a_step + j] * b[u * b_step + j];
}

constexpr int64_t kMlaTile = 8;  // queries sharing each weight / key row load (dots8)

// Absorbed MLA over a chunk: per (row, head) task, the queries 8 at a time. Query t (position S - T + t) of row b
// reads q at q + ((b T + t) H + h) (nope + rope), the keys rows + b row_stride + s R (s <= its position, R = r + rope),
// writes out + ((b T + t) H + h) v. Per query the decode step's `mla_heads` arithmetic: a = W_uk[h]^T q_nope (axpy's
// lanes, n in order) and q_rope, the scores dot(a, row) * scale 64 keys a block from key 0 through `softmax_block`,
// then o / l and W_uv[h] o by `dot`: a query's bits do not depend on the chunk it comes in or the thread count.
struct MlaTokens {
  const float *q, *rows, *w_uk, *w_uv;
  float* out;
  int64_t row_stride, T, S, H, r, nope, rope, v;
  float scale;
};

void mla_tokens(const void* ctx, int64_t i0, int64_t i1) {
  const MlaTokens& c = *static_cast<const MlaTokens*>(ctx);
  const int64_t r = c.r, R = r + c.rope, qd = c.nope + c.rope, H = c.H, first = c.S - c.T;
  thread_local std::vector<float> qa, qT, acc, scores, none;
  qa.resize(kMlaTile * R);
  qT.resize(c.nope * kMlaTile);
  acc.resize(kMlaTile * r);
  scores.resize(kMlaTile * 64);
  none.assign(qd, 0.0f);  // the query of a tile's unused places: zeros
  // the thread_local buffers' addresses once (each use of a thread_local in a shared library is a call)
  float *qa_ = qa.data(), *qT_ = qT.data(), *acc_ = acc.data(), *scores_ = scores.data();
  const float* zero = none.data();
  float mx[kMlaTile], l[kMlaTile], res[kMlaTile];
  alignas(32) float p[kMlaTile * 64];
  const float* keys[64];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / H, h = i % H;
    const float* w_uk = c.w_uk + h * c.nope * r;
    const float* w_uv = c.w_uv + h * c.v * r;
    const float* rows = c.rows + b * c.row_stride;
    for (int64_t t0 = 0; t0 < c.T; t0 += kMlaTile) {
      const int64_t nt = std::min(kMlaTile, c.T - t0);
      const float* q[kMlaTile];
      for (int64_t u = 0; u < kMlaTile; ++u) q[u] = u < nt ? c.q + ((b * c.T + t0 + u) * H + h) * qd : zero;
      for (int64_t n = 0; n < c.nope; ++n)
        for (int64_t u = 0; u < kMlaTile; ++u) qT[n * kMlaTile + u] = q[u][n];
      int64_t j = 0;
      for (; j + 8 <= r; j += 8) {  // a = W_uk^T q_nope, 8 lanes of every query at once
        __m256 a[kMlaTile];
        for (int64_t u = 0; u < kMlaTile; ++u) a[u] = _mm256_setzero_ps();
        for (int64_t n = 0; n < c.nope; ++n) {
          const __m256 w = _mm256_loadu_ps(w_uk + n * r + j);
          const float* qn = qT_ + n * kMlaTile;
          for (int64_t u = 0; u < kMlaTile; ++u) a[u] = _mm256_fmadd_ps(_mm256_broadcast_ss(qn + u), w, a[u]);
        }
        for (int64_t u = 0; u < kMlaTile; ++u) _mm256_storeu_ps(qa_ + u * R + j, a[u]);
      }
      for (int64_t u = 0; u < kMlaTile; ++u) {
        float* a = qa_ + u * R;
        for (int64_t k = j; k < r; ++k) a[k] = 0.0f;
        for (int64_t n = 0; n < c.nope; ++n)
          for (int64_t k = j; k < r; ++k) a[k] += q[u][n] * w_uk[n * r + k];
        std::memcpy(a + r, q[u] + c.nope, c.rope * sizeof(float));
      }
      std::fill(acc_, acc_ + kMlaTile * r, 0.0f);
      for (int64_t u = 0; u < kMlaTile; ++u) mx[u] = -INFINITY, l[u] = 0.0f;
      const int64_t last = first + t0 + nt;  // keys the tile's last query sees
      for (int64_t s0 = 0; s0 < last; s0 += 64) {
        const int64_t n = std::min<int64_t>(64, last - s0);
        for (int64_t s = 0; s < n; ++s) {
          keys[s] = rows + (s0 + s) * R;
          dots8(qa_, R, keys[s], 0, R, res);
          for (int64_t u = 0; u < kMlaTile; ++u) scores[u * 64 + s] = res[u];
        }
        int64_t seen[kMlaTile];
        for (int64_t u = 0; u < kMlaTile; ++u) {  // query t0 + u sees the keys up to its position; none past the tile
          seen[u] = u < nt ? std::min<int64_t>(n, first + t0 + u + 1 - s0) : 0;
          for (int64_t s = 0; s < std::max<int64_t>(0, seen[u]); ++s) p[u * 64 + s] = scores[u * 64 + s] * c.scale;
        }
        localmoe_hybrid::softmax_block<kMlaTile>(p, seen, n, keys, r, mx, l, acc_);
      }
      for (int64_t u = 0; u < nt; ++u) {
        float* o = acc_ + u * r;
        const float inv = 1.0f / l[u];
        for (int64_t k = 0; k < r; ++k) o[k] *= inv;
      }
      for (int64_t vv = 0; vv < c.v; ++vv) {  // out = W_uv o
        dots8(w_uv + vv * r, 0, acc_, r, r, res);
        for (int64_t u = 0; u < nt; ++u) c.out[((b * c.T + t0 + u) * H + h) * c.v + vv] = res[u];
      }
    }
  }
}

}  // namespace

extern "C" {

// The delta rule over T tokens, token by token as the fused decode step runs it (the same bits per token): KDA
// (g [B, T, H, K], a log-decay per channel) or Gated DeltaNet (scalar_decay: g [B, T, H]); q, k [B, T, H, K] (q
// normalised and scaled, k normalised), v, o [B, T, H, V], beta [B, T, H], state [B, H, K, V] updated in place; all
// fp32, contiguous; K, V <= 512. One task per (batch row, head): the bits do not depend on the thread count.
void delta_rule_tokens(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                       int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, int scalar_decay, float* o, int threads) {
  const DeltaTokens c{q, k, v, g, beta, o, state, T, H, K, V, 1, scalar_decay, H * K, H * V, scalar_decay ? H : H * K};
  localmoe::parallel(delta_tokens, &c, B * H, 1, threads);
}

// One KDA layer's chunk between its projections (engine/layers/kda.py): y [B, T, stride] in_proj's output (q k v |
// f_a | b | gate; its q k v replaced by the conv + SiLU's, q / k l2-normed), f [B, T, H K] f_b's output (replaced
// by the log-decay), gate [B, T, gate_stride] the output gate's input to the sigmoid (g_b's output, or y's gate
// part: K3), valid [B, T] (1 / 0) or null, state [B, H, K, K] and tail [B, W-1, 3 H K] advanced in place ->
// o [B, T, H K], the o_proj input. conv [3 H K, W], decay [H] exp(A_log), dt_bias [H K], o_norm [K]; bounded: K3's
// lower_bound * sigmoid gate. Per token the fused decode step's `kda_step` arithmetic. K <= 512, W <= 17.
void kda_chunk(float* y, int64_t stride, float* f, const float* gate, int64_t gate_stride, const float* valid,
               int64_t B, int64_t T, const float* conv, const float* decay, const float* dt_bias, const float* o_norm,
               float* state, float* tail, int64_t H, int64_t K, int64_t W, int64_t bounded, float lower_bound,
               float eps, float* o, int threads) {
  localmoe_hybrid::Kda a{};
  a.conv = conv, a.decay = decay, a.dt_bias = dt_bias, a.o_norm = o_norm;
  a.heads = H, a.head_dim = K, a.conv_kernel = W, a.bounded = bounded, a.lower_bound = lower_bound, a.eps = eps;
  const int64_t N = B * T, C = 3 * H * K;
  std::vector<float> beta(N * H);
  conv_rows(y, stride, B, T, conv, tail, C, W, threads);
  KdaTokens ctx{&a, y, f, beta.data(), o, gate, stride, gate_stride, 0};
  localmoe::parallel(kda_tokens, &ctx, N, 8, threads);
  mask(valid, N, f, H * K, beta.data(), H);
  const DeltaTokens d{y, y + H * K, y + 2 * H * K, f, beta.data(), o, state, T, H, K, K, 1, 0, stride, stride, H * K};
  localmoe::parallel(delta_tokens, &d, B * H, 1, threads);
  ctx.out = 1;
  localmoe::parallel(kda_tokens, &ctx, N, 8, threads);
}

// One Gated DeltaNet layer's chunk between its projections (engine/layers/gated_deltanet.py): y [B, T, stride]
// in_proj's output (q k v | z | b | a; its q k v replaced by the conv + SiLU's, q / k l2-normed), valid [B, T] or
// null, state [B, Hv, K, V] and tail [B, W-1, C] (C = 2 Hk K + Hv V) advanced in place -> o [B, T, Hv V], the
// out_proj input. Value head h reads key head h / (Hv / Hk) (no repeated q / k). conv [C, W], decay [Hv] exp(A_log),
// dt_bias [Hv], norm [V]. Per token the fused decode step's `gdn_step` arithmetic. K, V <= 512, W <= 17.
void gdn_chunk(float* y, int64_t stride, const float* valid, int64_t B, int64_t T, const float* conv,
               const float* decay, const float* dt_bias, const float* norm, float* state, float* tail, int64_t Hk,
               int64_t Hv, int64_t K, int64_t V, int64_t W, float eps, float* o, int threads) {
  localmoe_hybrid::Gdn a{};
  a.conv = conv, a.decay = decay, a.dt_bias = dt_bias, a.norm = norm;
  a.key_heads = Hk, a.value_heads = Hv, a.key_dim = K, a.value_dim = V, a.conv_kernel = W, a.eps = eps;
  const int64_t N = B * T, C = localmoe_hybrid::gdn_channels(a);
  std::vector<float> g(N * Hv), beta(N * Hv);
  conv_rows(y, stride, B, T, conv, tail, C, W, threads);
  GdnTokens ctx{&a, y, g.data(), beta.data(), o, stride, 0};
  localmoe::parallel(gdn_tokens, &ctx, N, 8, threads);
  mask(valid, N, g.data(), Hv, beta.data(), Hv);
  const DeltaTokens d{y, y + Hk * K, y + 2 * Hk * K, g.data(), beta.data(), o, state, T, Hv, K, V, Hv / Hk, 1,
                      stride, stride, Hv};
  localmoe::parallel(delta_tokens, &d, B * Hv, 1, threads);
  ctx.out = 1;
  localmoe::parallel(gdn_tokens, &ctx, N, 8, threads);
}

// Absorbed MLA attention for a chunk of T queries of B rows over S >= T cached latent rows (engine/layers/mla.py, no
// mask: query t at position S - T + t sees keys 0 .. S - T + t). q [B, T, H, nope + rope] (rope part as cached:
// rotated or NoPE), rows: row b's [S, r + rope] at rows + b row_stride, w_uk [H, nope, r], w_uv [H, v, r] ->
// out [B, T, H v], all fp32. One task per (row, head); per query the decode step's arithmetic (MlaTokens).
void mla_chunk(const float* q, const float* rows, int64_t row_stride, int64_t B, int64_t T, int64_t S,
               const float* w_uk, const float* w_uv, int64_t H, int64_t r, int64_t nope, int64_t rope, int64_t v,
               float scale, float* out, int threads) {
  const MlaTokens c{q, rows, w_uk, w_uv, out, row_stride, T, S, H, r, nope, rope, v, scale};
  localmoe::parallel(mla_tokens, &c, B * H, 1, threads);
}

}  // extern "C"
