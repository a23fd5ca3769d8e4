// Decode attention over every head (AVX2 + FMA), shared by `gqa_decode` (gqa_cpu.cpp), the fused
// attention decode step (step_cpu.cpp) and the batched decode over paged caches (paged_cpu.cpp); what
// it computes and how: gqa_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "pool.h"
#include "vec_math.h"

namespace localmoe_gqa {

using localmoe::hsum;

constexpr int64_t kKeys = 64;  // keys per online-softmax block
constexpr int64_t kMaxDim = 512;

struct Args {
  const float* q;
  int64_t qb, qh;  // q[b * qb + h * qh + d]
  int64_t H, group, D;
  const float* k;
  int64_t kb, kh, ks;
  const float* v;
  int64_t vb, vh, vs;
  int64_t first, S;
  const uint8_t* visible;  // [B, S] bool (stride mb) or null: every key visible
  int64_t mb;
  const float* sinks;  // [H] or null
  float scale;
  float* out;  // [B, H, D]
};

// Key and value rows of one KV head at a constant stride (a contiguous cache, or a view of one).
struct StridedRows {
  const float *k, *v;
  int64_t ks, vs;
  const float* key(int64_t s) const { return k + s * ks; }
  const float* value(int64_t s) const { return v + s * vs; }
};

// out [D] = attention of one query head q [D] over the keys s in [first, S) that `vis` allows (null:
// all), with an optional sink logit (null: none): online softmax over blocks of kKeys keys.
template <class Rows>
inline void one_head(const float* q, const Rows& rows, int64_t first, int64_t S, const uint8_t* vis,
                     const float* sink, float scale, int64_t D, float* o) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t nv = D / 8;
  __m256 acc[kMaxDim / 8];
  for (int64_t j = 0; j < nv; ++j) acc[j] = _mm256_setzero_ps();
  float m = sink ? *sink : neg_inf, l = sink ? 1.0f : 0.0f;  // the sink: e^(sink - m) with m = sink
  alignas(32) float score[kKeys];
  for (int64_t s0 = first; s0 < S; s0 += kKeys) {
    const int64_t n = std::min(kKeys, S - s0);
    float top = neg_inf;
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t s = s0 + j;
      if (j >= n || (vis && !vis[s])) {
        score[j] = neg_inf;
        continue;
      }
      const float* kr = rows.key(s);
      __m256 d = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
      for (int64_t t = 1; t < nv; ++t) d = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * t), _mm256_loadu_ps(kr + 8 * t), d);
      score[j] = hsum(d) * scale;
      top = std::max(top, score[j]);
    }
    if (top == neg_inf) continue;
    if (top > m) {  // rescale what was summed against the new maximum
      const float f = std::exp(m - top);  // 0 while nothing was summed (m = -inf)
      for (int64_t j = 0; j < nv; ++j) acc[j] = _mm256_mul_ps(acc[j], _mm256_set1_ps(f));
      l *= f;
      m = top;
    }
    const __m256 vm = _mm256_set1_ps(m);
    __m256 psum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kKeys; j += 8) {  // -inf scores give exactly 0 (exp_ps clamps and flushes)
      const __m256 p = localmoe::exp_ps(_mm256_sub_ps(_mm256_load_ps(score + j), vm));
      _mm256_store_ps(score + j, p);
      psum = _mm256_add_ps(psum, p);
    }
    l += hsum(psum);
    for (int64_t j = 0; j < n; ++j) {
      if (score[j] == 0.0f) continue;
      const __m256 p = _mm256_set1_ps(score[j]);
      const float* vr = rows.value(s0 + j);
      for (int64_t t = 0; t < nv; ++t) acc[t] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * t), acc[t]);
    }
  }
  const __m256 inv = _mm256_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
  for (int64_t t = 0; t < nv; ++t) _mm256_storeu_ps(o + 8 * t, _mm256_mul_ps(acc[t], inv));
}

inline void heads(const void* ctx, int64_t i0, int64_t i1) {
  const Args& a = *static_cast<const Args*>(ctx);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / a.H, h = i % a.H, kvh = h / a.group;
    const StridedRows rows{a.k + b * a.kb + kvh * a.kh, a.v + b * a.vb + kvh * a.vh, a.ks, a.vs};
    one_head(a.q + b * a.qb + h * a.qh, rows, a.first, a.S, a.visible ? a.visible + b * a.mb : nullptr,
             a.sinks ? a.sinks + h : nullptr, a.scale, a.D, a.out + i * a.D);
  }
}

}  // namespace localmoe_gqa
