// One decode step of a grouped-query attention layer for one sequence, in one call (AVX2 + FMA):
//
//   qkv = x W_qkv^T + b_qkv                        rows [q: H x D | k: Hkv x D | v: Hkv x D]
//   q, k <- RoPE on their first `rot` dims         x * cos + rotate_half(x) * signed_sin (the tables
//                                                  of engine/rope.py at this position)
//   K[:, pos], V[:, pos] <- k, v                   the fp32 cache pool, written in place
//   a = attention of q over keys [first, pos]      gqa_heads.h (window start `first`, optional sinks)
//   out = a W_o^T + b_o
//
// The torch path for the same step was ~20 small ops per layer (split, views, three for RoPE, two
// cache writes and reads, the attention call, two GEMV calls); after each layer's weight stream
// evicts the caches each costs 3-4x its isolated time, so on a small model they cost more than the
// attention weights' bytes. The GEMVs and the attention are the dense and GQA kernels' own code
// (dense_rows.h, gqa_heads.h) on the library's pool; RoPE and the cache write are ~1 us of serial
// work between them. Every row and head is computed whole by one thread: the bits do not depend on
// the thread count.
#include <cstdint>

#include "../dense_gemv/dense_rows.h"
#include "gqa_heads.h"

namespace {

// x [rot] <- x * cos + rotate_half(x) * ssin, rotate_half(x)[i] = x[i + rot/2] (i < rot/2), x[i - rot/2].
void rope(float* x, int64_t rot, const float* cos, const float* ssin) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * ssin[i];
    x[i + half] = b * cos[i + half] + a * ssin[i + half];
  }
}

template <typename TQ, typename TO>
void step(const float* x, int64_t hidden, const TQ* wqkv, const float* bqkv, int64_t H, int64_t Hkv, int64_t D,
          int64_t rot, const float* cos, const float* ssin, float* kpool, float* vpool, int64_t head_stride,
          int64_t pos, int64_t first, const float* sinks, float scale, const TO* wo, const float* bo, float* out,
          float* scratch, int threads) {
  float* qkv = scratch;                   // [(H + 2 Hkv) D]
  float* attn = scratch + (H + 2 * Hkv) * D;  // [H D]
  localmoe_dense::gemv<TQ>(x, 1, hidden, wqkv, (H + 2 * Hkv) * D, bqkv, qkv, threads);
  for (int64_t h = 0; h < H + Hkv; ++h) rope(qkv + h * D, rot, cos, ssin);
  for (int64_t h = 0; h < Hkv; ++h) {
    std::copy_n(qkv + (H + h) * D, D, kpool + h * head_stride + pos * D);
    std::copy_n(qkv + (H + Hkv + h) * D, D, vpool + h * head_stride + pos * D);
  }
  const localmoe_gqa::Args args{qkv, 0, D, H, H / Hkv, D, kpool, 0, head_stride, D, vpool, 0, head_stride, D,
                                first, pos + 1, nullptr, 0, sinks, scale, attn};
  const int64_t bytes_per_head = std::max<int64_t>(1, (pos + 1 - first) * D * 8);
  localmoe::parallel(localmoe_gqa::heads, &args, H, localmoe::kChunkBytes / bytes_per_head, threads);
  localmoe_dense::gemv<TO>(attn, 1, H * D, wo, hidden, bo, out, threads);
}

}  // namespace

extern "C" {

// Floats of scratch gqa_step needs.
int64_t gqa_step_scratch(int64_t H, int64_t Hkv, int64_t D) { return (2 * H + 2 * Hkv) * D; }

// out [hidden] = the layer's attention output for x [hidden] at cache position pos (see the top of
// this file). wqkv [(H + 2 Hkv) D, hidden] and wo [hidden, H D] are fp32, or bf16 bits where
// qkv_bf16 / o_bf16; biases fp32 or null; cos/ssin [rot]; kpool/vpool: head h's position s at
// h * head_stride + s * D, fp32, room for pos; sinks [H] or null.
void gqa_step(const float* x, int64_t hidden, const void* wqkv, int qkv_bf16, const float* bqkv, int64_t H,
              int64_t Hkv, int64_t D, int64_t rot, const float* cos, const float* ssin, float* kpool, float* vpool,
              int64_t head_stride, int64_t pos, int64_t first, const float* sinks, float scale, const void* wo,
              int o_bf16, const float* bo, float* out, float* scratch, int threads) {
  const auto* q32 = static_cast<const float*>(wqkv);
  const auto* q16 = static_cast<const uint16_t*>(wqkv);
  const auto* o32 = static_cast<const float*>(wo);
  const auto* o16 = static_cast<const uint16_t*>(wo);
  if (!qkv_bf16 && !o_bf16)
    step(x, hidden, q32, bqkv, H, Hkv, D, rot, cos, ssin, kpool, vpool, head_stride, pos, first, sinks, scale, o32,
         bo, out, scratch, threads);
  else if (qkv_bf16 && o_bf16)
    step(x, hidden, q16, bqkv, H, Hkv, D, rot, cos, ssin, kpool, vpool, head_stride, pos, first, sinks, scale, o16,
         bo, out, scratch, threads);
  else if (qkv_bf16)
    step(x, hidden, q16, bqkv, H, Hkv, D, rot, cos, ssin, kpool, vpool, head_stride, pos, first, sinks, scale, o32,
         bo, out, scratch, threads);
  else
    step(x, hidden, q32, bqkv, H, Hkv, D, rot, cos, ssin, kpool, vpool, head_stride, pos, first, sinks, scale, o16,
         bo, out, scratch, threads);
}

}  // extern "C"
