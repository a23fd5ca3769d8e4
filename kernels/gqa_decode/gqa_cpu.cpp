// Grouped-query attention for one new query per sequence (decode) on the CPU (AVX2 + FMA).
//
// out[b, h] = softmax over the visible keys s in [first, S) of (q[b, h] . k[b, h / G, s]) * scale,
// with an optional per-head sink logit in the denominator (gpt-oss: it takes probability mass and
// adds no value), applied to v[b, h / G, s]. The torch path for this was ~25 small ops per layer
// and step (mask, window, repeat, cat, softmax, two matmuls); here one call does every head.
//
// One pass over the keys per KV head for all its query heads (gqa_heads.h: each key and value row read once
// for them; online softmax, blocks of 64 keys): no [H, S] score buffer, so a long context costs no extra
// memory. Each (sequence, KV head) is computed whole by one thread, each query head with its own operations,
// so the bits do not depend on the thread count. K/V are read through strides (a view of the paged cache's
// pool, or a gathered copy); their last dimension is contiguous. D is a multiple of 8, at most 512.
#include <algorithm>
#include <cstdint>

#include "gqa_heads.h"

using localmoe_gqa::Args;
using localmoe_gqa::heads;

extern "C" {

// out [B, H, D] fp32 (see the top of this file); strides in elements; H = Hkv * group.
void gqa_decode(const float* q, int64_t qb, int64_t qh, int64_t B, int64_t H, int64_t group, int64_t D,
                const float* k, int64_t kb, int64_t kh, int64_t ks, const float* v, int64_t vb, int64_t vh,
                int64_t vs, int64_t first, int64_t S, const uint8_t* visible, int64_t mb, const float* sinks,
                float scale, float* out, int threads) {
  const Args args{q, qb, qh, H, group, D, k, kb, kh, ks, v, vb, vh, vs, first, S, visible, mb, sinks, scale, out};
  const int64_t bytes_per_head = std::max<int64_t>(1, (S - first) * D * 8);
  localmoe::parallel(heads, &args, B * (H / group), localmoe::kChunkBytes / bytes_per_head, threads);
}

}  // extern "C"
