// One GQA layer's decode step for one sequence, shared by `gqa_step` (step_cpu.cpp) and the
// whole-stack decode calls (kernels/decode_layers); what it computes and why: step_cpu.cpp's header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <vector>

#include "../_cpu/matrix.h"
#include "gqa_heads.h"

namespace localmoe_gqa {

// x [r/2] <- x * cos + rotate_half(x) * ssin over the first `rot` values (rotate_half(x)[i] =
// x[i + rot/2] for i < rot/2, else x[i - rot/2]).
inline void rope(float* x, int64_t rot, const float* cos, const float* ssin) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * ssin[i];
    x[i + half] = b * cos[i + half] + a * ssin[i + half];
  }
}

// x [D] <- x * rsqrt(mean(x^2) + eps) * w (Qwen3's per-head q/k norm).
inline void head_rms_norm(float* x, int64_t D, const float* w, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) x[i] = x[i] * r * w[i];
}

// Floats of `scratch` attention_step needs.
inline int64_t step_scratch(int64_t H, int64_t Hkv, int64_t D) { return (2 * H + 2 * Hkv) * D; }

// The token's q, k and v heads ([(H + 2 Hkv) D] into qkv): the projection, the per-head RMSNorms (q_norm null:
// none) and RoPE, as both attention steps below compute them.
inline void project_qkv(const float* x, const localmoe::Matrix& qkv_w, int64_t H, int64_t Hkv, int64_t D, int64_t rot,
                        const float* cos, const float* ssin, const float* q_norm, const float* k_norm, float eps,
                        float* qkv, void* xq, int threads) {
  localmoe::matvec(qkv_w, x, qkv, xq, threads);
  if (q_norm != nullptr)
    for (int64_t h = 0; h < H + Hkv; ++h) head_rms_norm(qkv + h * D, D, h < H ? q_norm : k_norm, eps);
  for (int64_t h = 0; h < H + Hkv; ++h) rope(qkv + h * D, rot, cos, ssin);
}

// attention_step after the projection: the token's k, v (of qkv [(H + 2 Hkv) D]) written at `pos` of the pools, then
// attn [H D] = each query head's attention over positions first..pos.
inline void attend_pools(const float* qkv, int64_t H, int64_t Hkv, int64_t D, float* kpool, float* vpool,
                         int64_t head_stride, int64_t pos, int64_t first, const float* sinks, float scale, float* attn,
                         int threads) {
  for (int64_t h = 0; h < Hkv; ++h) {
    std::copy_n(qkv + (H + h) * D, D, kpool + h * head_stride + pos * D);
    std::copy_n(qkv + (H + Hkv + h) * D, D, vpool + h * head_stride + pos * D);
  }
  const Args args{qkv, 0, D, H, H / Hkv, D, kpool, 0, head_stride, D, vpool, 0, head_stride, D,
                  first, pos + 1, nullptr, 0, sinks, scale, attn};
  const int64_t bytes_per_head = std::max<int64_t>(1, (pos + 1 - first) * D * 8);
  localmoe::parallel(heads, &args, Hkv, localmoe::kChunkBytes / bytes_per_head, threads);
}

// out [hidden] = o(attention(rope(norm(qkv x)))) with k, v written at `pos` of the pools (head h's
// position s at h * head_stride + s * D); q_norm / k_norm [D]: per-head RMSNorm of q and k before
// RoPE (null: none), eps theirs; xq: matvec scratch for GGUF-block matrices (null for fp32/bf16).
inline void attention_step(const float* x, const localmoe::Matrix& qkv_w, const localmoe::Matrix& o_w, int64_t H,
                           int64_t Hkv, int64_t D, int64_t rot, const float* cos, const float* ssin, float* kpool,
                           float* vpool, int64_t head_stride, int64_t pos, int64_t first, const float* sinks,
                           float scale, const float* q_norm, const float* k_norm, float eps, float* out,
                           float* scratch, void* xq, int threads) {
  float* qkv = scratch;                        // [(H + 2 Hkv) D]
  float* attn = scratch + (H + 2 * Hkv) * D;  // [H D]
  project_qkv(x, qkv_w, H, Hkv, D, rot, cos, ssin, q_norm, k_norm, eps, qkv, xq, threads);
  attend_pools(qkv, H, Hkv, D, kpool, vpool, head_stride, pos, first, sinks, scale, attn, threads);
  localmoe::matvec(o_w, attn, out, xq, threads);
}

struct CachedArgs {
  const float* q;  // [H, D]
  int64_t H, group, D;
  const localmoe_cache::CacheRows *k, *v;
  int64_t first, S;
  const float* sinks;
  float scale;
  float* out;  // [H, D]
};

// Tasks i0 .. i1: KV head i and the `group` query heads that read it, over a bf16 / fp8 cache.
inline void cached_heads(const void* ctx, int64_t i0, int64_t i1) {
  const CachedArgs& a = *static_cast<const CachedArgs*>(ctx);
  thread_local std::vector<float> buf;
  buf.resize(2 * kKeys * a.D);  // a block's widened keys and values
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t h = i * a.group;
    const CachedRows rows{a.k, a.v, i, a.S, buf.data(), buf.data() + kKeys * a.D};
    group_heads(a.q + h * a.D, a.D, a.group, rows, a.first, a.S, nullptr, a.sinks ? a.sinks + h : nullptr, a.scale,
                a.D, a.out + h * a.D);
  }
}

// attend_pools over a cache in its own dtype (k, v: cache_rows.h views of one sequence's K and V buffers): the
// token's rows written as the engine writes them, the heads reading the dequantised rows (`cached_heads`).
inline void attend_cached(const float* qkv, int64_t H, int64_t Hkv, int64_t D, const localmoe_cache::CacheRows& k,
                          const localmoe_cache::CacheRows& v, int64_t pos, int64_t first, const float* sinks,
                          float scale, float* attn, int threads) {
  localmoe_cache::write(k, pos, qkv + H * D);
  localmoe_cache::write(v, pos, qkv + (H + Hkv) * D);
  const CachedArgs args{qkv, H, H / Hkv, D, &k, &v, first, pos + 1, sinks, scale, attn};
  const int64_t bytes_per_head = std::max<int64_t>(1, (pos + 1 - first) * D * 4);
  localmoe::parallel(cached_heads, &args, Hkv, localmoe::kChunkBytes / bytes_per_head, threads);
}

// attention_step over a cache in its own dtype (k, v: cache_rows.h views of one sequence's K and V buffers,
// Hkv heads of D values; the token's rows written as the engine writes them): the same projections, norms and
// RoPE, the heads reading the dequantised rows (`cached_heads`).
inline void attention_step_cached(const float* x, const localmoe::Matrix& qkv_w, const localmoe::Matrix& o_w,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t rot, const float* cos, const float* ssin,
                                  const localmoe_cache::CacheRows& k, const localmoe_cache::CacheRows& v, int64_t pos,
                                  int64_t first, const float* sinks, float scale, const float* q_norm,
                                  const float* k_norm, float eps, float* out, float* scratch, void* xq, int threads) {
  float* qkv = scratch;                        // [(H + 2 Hkv) D]
  float* attn = scratch + (H + 2 * Hkv) * D;  // [H D]
  project_qkv(x, qkv_w, H, Hkv, D, rot, cos, ssin, q_norm, k_norm, eps, qkv, xq, threads);
  attend_cached(qkv, H, Hkv, D, k, v, pos, first, sinks, scale, attn, threads);
  localmoe::matvec(o_w, attn, out, xq, threads);
}

}  // namespace localmoe_gqa
