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
// cache writes and reads, the attention call, two GEMV calls); after each layer's weight stream evicts
// the caches each costs 3-4x its isolated time, so on a small model they cost more than the attention
// weights' bytes. The GEMVs and the attention are the dense and GQA kernels' own code
// (kernels/_cpu/matrix.h, gqa_heads.h; the step itself is gqa_step.h) on the library's pool; RoPE and
// the cache write are ~1 us of serial work between them. Every row and head is computed whole by one
// thread: the bits do not depend on the thread count.
#include <cstdint>

#include "gqa_step.h"

extern "C" {

// Floats of scratch gqa_step needs.
int64_t gqa_step_scratch(int64_t H, int64_t Hkv, int64_t D) { return localmoe_gqa::step_scratch(H, Hkv, D); }

// out [hidden] = the layer's attention output for x [hidden] at cache position pos (see the top of
// this file). wqkv [(H + 2 Hkv) D, hidden] and wo [hidden, H D] are fp32, or bf16 bits where
// qkv_bf16 / o_bf16; biases fp32 or null; cos/ssin [rot]; kpool/vpool: head h's position s at
// h * head_stride + s * D, fp32, room for pos; sinks [H] or null; q_norm / k_norm [D] or null (both or
// neither) with their eps.
void gqa_step(const float* x, int64_t hidden, const void* wqkv, int qkv_bf16, const float* bqkv, int64_t H,
              int64_t Hkv, int64_t D, int64_t rot, const float* cos, const float* ssin, float* kpool, float* vpool,
              int64_t head_stride, int64_t pos, int64_t first, const float* sinks, float scale, const float* q_norm,
              const float* k_norm, float eps, const void* wo, int o_bf16, const float* bo, float* out,
              float* scratch, int threads) {
  const localmoe::Matrix qkv{wqkv, qkv_bf16 ? localmoe::kBF16 : localmoe::kF32, (H + 2 * Hkv) * D, hidden, bqkv};
  const localmoe::Matrix o{wo, o_bf16 ? localmoe::kBF16 : localmoe::kF32, hidden, H * D, bo};
  localmoe_gqa::attention_step(x, qkv, o, H, Hkv, D, rot, cos, ssin, kpool, vpool, head_stride, pos, first, sinks,
                               scale, q_norm, k_norm, eps, out, scratch, nullptr, threads);
}

}  // extern "C"
