// Decode attention over every head (AVX2 + FMA), shared by `gqa_decode` (gqa_cpu.cpp), the fused
// attention decode step (step_cpu.cpp) and the batched decode over paged caches (paged_cpu.cpp); what
// it computes and how: gqa_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../fp8_cache/cache_rows.h"
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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32, exact (bf16_widen's values)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// A block's first n rows as stored bf16 rows, key j at k + j * D and value j at v + j * D (read and widened in
// registers by the pass), or n = 0.
struct RawRows {
  const uint16_t *k, *v;
  int64_t n;
};

// Key and value rows of one KV head at a constant stride (a contiguous cache, or a view of one).
// A Rows type gives group_pass a block's rows: raw(s0, n) its first rows as stored bf16 rows (none but for a bf16
// cache), keys(s0, n, vis, kr) sets kr[j] to the key row of position s0 + j (j < n; null where vis, if given, hides
// it; for a raw row only non-null), values(s0, n, kr, vr) vr[j] to its value row where kr[j] is set and j is not raw.
struct StridedRows {
  const float *k, *v;
  int64_t ks, vs;
  RawRows raw(int64_t, int64_t) const { return {nullptr, nullptr, 0}; }
  void keys(int64_t s0, int64_t n, const uint8_t* vis, const float** kr) const {
    for (int64_t j = 0; j < n; ++j) kr[j] = vis && !vis[j] ? nullptr : k + (s0 + j) * ks;
  }
  void values(int64_t s0, int64_t n, const float* const* kr, const float** vr) const {
    for (int64_t j = 0; j < n; ++j) vr[j] = v + (s0 + j) * vs;
  }
};

// Key and value rows of one KV head read from a bf16 / fp8 cache (fp8_cache/cache_rows.h: the engine's
// dequantisation and exact ring), widened as `group_pass` asks for them: a block's keys into `kbuf`
// [kKeys, D], its values into `vbuf` [kKeys, D] (kKeys consecutive positions take distinct slots); a bf16 cache's
// positions older than the ring's are raw rows, widened in registers (the same values). A head's operations and
// their order are those over fp32 pools.
struct CachedRows {
  const localmoe_cache::CacheRows *k, *v;
  int64_t h, length;
  float *kbuf, *vbuf;
  RawRows raw(int64_t s0, int64_t n) const {
    if (k->dtype != localmoe_cache::kBF16 || v->dtype != localmoe_cache::kBF16) return {nullptr, nullptr, 0};
    const int64_t r = std::min(n, std::max<int64_t>(0, length - std::max(k->ring, v->ring) - s0));
    return {static_cast<const uint16_t*>(k->pool) + (h * k->capacity + s0) * k->dim,
            static_cast<const uint16_t*>(v->pool) + (h * v->capacity + s0) * v->dim, r};
  }
  void keys(int64_t s0, int64_t n, const uint8_t* vis, const float** kr) const {
    const int64_t r = raw(s0, n).n;
    for (int64_t j = 0; j < n; ++j)
      kr[j] = vis && !vis[j] ? nullptr : j < r ? kbuf : localmoe_cache::row(*k, h, s0 + j, length, kbuf + j * k->dim);
  }
  void values(int64_t s0, int64_t n, const float* const* kr, const float** vr) const {
    for (int64_t j = raw(s0, n).n; j < n; ++j)
      if (kr[j] != nullptr) vr[j] = localmoe_cache::row(*v, h, s0 + j, length, vbuf + j * v->dim);
  }
};

// The query heads that share one KV head, computed together: each key and value row is loaded once for
// all of them (and their dot products interleave), while every head's own operations and their order are
// those it has alone, so a head's bits do not depend on how many share the pass.
constexpr int64_t kGroup = 4;  // query heads per pass (their accumulators: kGroup x D floats)

// d[g] = the 8 lane sums of query head g's products with key row k (a multiply, then FMAs over D / 8 steps).
template <class T>
inline void key_lanes(const float* q, int64_t qh, int64_t G, int64_t nv, const T* k, __m256* d) {
  const __m256 k0 = load8(k);
  for (int64_t g = 0; g < G; ++g) d[g] = _mm256_mul_ps(_mm256_loadu_ps(q + g * qh), k0);
  for (int64_t t = 1; t < nv; ++t) {
    const __m256 kt = load8(k + 8 * t);
    for (int64_t g = 0; g < G; ++g) d[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * qh + 8 * t), kt, d[g]);
  }
}

// out[g * D ..] = attention of query head g < G (q + g * qh, [D] each) over the keys s in [first, S) that
// `vis` allows (null: all), with an optional sink logit per head (sinks[g]; null: none): online softmax
// over blocks of kKeys keys. G <= kGroup. A score is hsum(lanes) * scale; eight keys' sums are taken together
// (vec_math.h hsum_halves / hsum_finish: hsum's additions, so the same bits).
// kNv, kG: D / 8 and G known at compile time (0: read from D, G), so that the accumulators can live in registers.
template <int64_t kNv, int64_t kG, class Rows>
inline void group_pass_fixed(const float* q, int64_t qh, int64_t G_, const Rows& rows, int64_t first, int64_t S,
                             const uint8_t* vis, const float* sinks, float scale, int64_t D, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t nv = kNv ? kNv : D / 8;
  const int64_t G = kG ? kG : G_;
  constexpr int64_t kGs = kG ? kG : kGroup, kNvs = kNv ? kNv : kMaxDim / 8;  // array sizes
  __m256 acc[kGs][kNvs];
  float m[kGs], l[kGs], top[kGs];
  alignas(32) float score[kGroup][kKeys];
  const float* kr[kKeys];
  const float* vr[kKeys];
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < nv; ++j) acc[g][j] = _mm256_setzero_ps();
    m[g] = sinks ? sinks[g] : neg_inf;  // the sink: e^(sink - m) with m = sink
    l[g] = sinks ? 1.0f : 0.0f;
  }
  for (int64_t s0 = first; s0 < S; s0 += kKeys) {
    const int64_t n = std::min(kKeys, S - s0), n8 = (n + 7) / 8 * 8;  // a short last block: its scores to n8 only
    const RawRows raw = rows.raw(s0, n);
    const int64_t dim = nv * 8;
    const auto lanes = [&](int64_t j, __m256* d) {  // key j's lane sums, from its raw or its fp32 row
      if (j < raw.n) key_lanes(q, qh, G, nv, raw.k + j * dim, d);
      else key_lanes(q, qh, G, nv, kr[j], d);
    };
    rows.keys(s0, n, vis ? vis + s0 : nullptr, kr);
    int64_t live = 0;
    for (int64_t j = 0; j < n; ++j) live += kr[j] != nullptr;
    if (live == 0) continue;
    __m256 vtop[kGs];
    for (int64_t g = 0; g < G; ++g) vtop[g] = _mm256_set1_ps(neg_inf);
    int64_t j = 0;
    for (; j + 8 <= n && live == n; j += 8) {  // eight keys at a time, two by two in order
      __m256 r[kGs][4];
      for (int64_t i = 0; i < 4; ++i) {
        __m256 a[kGs], b[kGs];
        lanes(j + 2 * i, a);
        lanes(j + 2 * i + 1, b);
        for (int64_t g = 0; g < G; ++g) r[g][i] = localmoe::hsum_halves(a[g], b[g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s = _mm256_mul_ps(localmoe::hsum_finish(r[g]), vscale);
        _mm256_store_ps(score[g] + j, s);
        vtop[g] = _mm256_max_ps(s, vtop[g]);  // a NaN score leaves the maximum, as std::max(top, s)
      }
    }
    for (int64_t g = 0; g < G; ++g) top[g] = localmoe::hmax(vtop[g]);
    for (; j < n8; ++j) {
      if (j >= n || kr[j] == nullptr) {
        for (int64_t g = 0; g < G; ++g) score[g][j] = neg_inf;
        continue;
      }
      __m256 d[kGs];
      lanes(j, d);
      for (int64_t g = 0; g < G; ++g) {
        score[g][j] = hsum(d[g]) * scale;
        top[g] = std::max(top[g], score[g][j]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      if (top[g] == neg_inf) {  // nothing to add for this head (its scores stay -inf: no value is read)
        for (int64_t j = 0; j < n8; ++j) score[g][j] = 0.0f;
        continue;
      }
      if (top[g] > m[g]) {  // rescale what was summed against the new maximum
        const float f = std::exp(m[g] - top[g]);  // 0 while nothing was summed (m = -inf)
        for (int64_t j = 0; j < nv; ++j) acc[g][j] = _mm256_mul_ps(acc[g][j], _mm256_set1_ps(f));
        l[g] *= f;
        m[g] = top[g];
      }
      const __m256 vm = _mm256_set1_ps(m[g]);
      __m256 psum = _mm256_setzero_ps();
      // -inf scores give exactly 0 (exp_ps clamps and flushes); those past n8 would add +0 to psum: left out
      for (int64_t j = 0; j < n8; j += 8) {
        const __m256 p = localmoe::exp_ps(_mm256_sub_ps(_mm256_load_ps(score[g] + j), vm));
        _mm256_store_ps(score[g] + j, p);
        psum = _mm256_add_ps(psum, p);
      }
      l[g] += hsum(psum);
    }
    rows.values(s0, n, kr, vr);
    const auto add = [&](int64_t j, const auto* v) {  // value row v weighted by each head's p of key j
      bool all = true;  // no head's weight 0 (a 0 adds nothing: it is skipped, as -0 + 0 and 0 * inf would differ)
      for (int64_t g = 0; g < G; ++g) all &= score[g][j] != 0.0f;
      if (all) {
        __m256 p[kGs];
        for (int64_t g = 0; g < G; ++g) p[g] = _mm256_set1_ps(score[g][j]);
        for (int64_t t = 0; t < nv; ++t) {
          const __m256 vt = load8(v + 8 * t);
          for (int64_t g = 0; g < G; ++g) acc[g][t] = _mm256_fmadd_ps(p[g], vt, acc[g][t]);
        }
        return;
      }
      for (int64_t g = 0; g < G; ++g) {
        if (score[g][j] == 0.0f) continue;
        const __m256 p = _mm256_set1_ps(score[g][j]);
        for (int64_t t = 0; t < nv; ++t) acc[g][t] = _mm256_fmadd_ps(p, load8(v + 8 * t), acc[g][t]);
      }
    };
    for (int64_t j = 0; j < n; ++j) {
      if (kr[j] == nullptr) continue;
      if (j < raw.n) add(j, raw.v + j * dim);
      else add(j, vr[j]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
    for (int64_t t = 0; t < nv; ++t) _mm256_storeu_ps(out + g * D + 8 * t, _mm256_mul_ps(acc[g][t], inv));
  }
}

// group_pass_fixed with D and G fixed where D is 64 (SmolLM2 and other small models): the same operations in the same
// order, so the same bits.
template <class Rows>
inline void group_pass(const float* q, int64_t qh, int64_t G, const Rows& rows, int64_t first, int64_t S,
                       const uint8_t* vis, const float* sinks, float scale, int64_t D, float* out) {
  static_assert(kGroup == 4, "the cases below");
  if (D == 64) {
    if (G == 1) return group_pass_fixed<8, 1>(q, qh, G, rows, first, S, vis, sinks, scale, D, out);
    if (G == 2) return group_pass_fixed<8, 2>(q, qh, G, rows, first, S, vis, sinks, scale, D, out);
    if (G == 3) return group_pass_fixed<8, 3>(q, qh, G, rows, first, S, vis, sinks, scale, D, out);
    return group_pass_fixed<8, 4>(q, qh, G, rows, first, S, vis, sinks, scale, D, out);
  }
  group_pass_fixed<0, 0>(q, qh, G, rows, first, S, vis, sinks, scale, D, out);
}

// out [G, D] (head g at out + g * D) = attention of the G query heads q + g * qh that read one KV head, in
// passes of kGroup heads (`group_pass`); sinks: [G] or null.
template <class Rows>
inline void group_heads(const float* q, int64_t qh, int64_t G, const Rows& rows, int64_t first, int64_t S,
                        const uint8_t* vis, const float* sinks, float scale, int64_t D, float* out) {
  for (int64_t g = 0; g < G; g += kGroup)
    group_pass(q + g * qh, qh, std::min(kGroup, G - g), rows, first, S, vis, sinks ? sinks + g : nullptr, scale, D,
               out + g * D);
}

// Tasks i0 .. i1 of B x Hkv: sequence b = i / Hkv, KV head i % Hkv and the `group` query heads that read it.
inline void heads(const void* ctx, int64_t i0, int64_t i1) {
  const Args& a = *static_cast<const Args*>(ctx);
  const int64_t Hkv = a.H / a.group;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / Hkv, kvh = i % Hkv, h = kvh * a.group;
    const StridedRows rows{a.k + b * a.kb + kvh * a.kh, a.v + b * a.vb + kvh * a.vh, a.ks, a.vs};
    group_heads(a.q + b * a.qb + h * a.qh, a.qh, a.group, rows, a.first, a.S, a.visible ? a.visible + b * a.mb : nullptr,
                a.sinks ? a.sinks + h : nullptr, a.scale, a.D, a.out + (b * a.H + h) * a.D);
  }
}

}  // namespace localmoe_gqa
