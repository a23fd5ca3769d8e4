// MXFP4 expert matmul on the CPU (AVX2 + FMA, or AVX-512 VNNI: mxfp4_rows.h), straight from the
// canonical bytes. Plain C ABI, no torch headers: it builds in about a second with gcc and is loaded
// with ctypes (kernels/mxfp4_moe/cpu.py; ctypes releases the GIL for the call).
//
// y[N, O] = x[N, K] W^T, W given as packed U8 [O, K/2] (element 2i in the low nibble of byte i)
// and E8M0 scales U8 [O, K/32] (bias 127, 0xFF = NaN).
//
// gemv, one token (decode), exact: x is split once per call, per 32-element block, into integer
// parts on a grid of step amax / 32639: x = step / 256 * (256 * hi + lo), |hi| <= 32639, lo int8,
// within ~2^-23 of the block's largest magnitude (about fp32's own rounding of that element). A
// pair of weight blocks (32 code bytes) is decoded with two pshufb lookups of 2 * e2m1 + 12 as u8
// (no sign extension needed: the +12 is taken off with a per-lane correction computed with x).
// AVX2: hi meets the weights zero-extended in place (and/shift) through vpmaddwd, lo through
// vpmaddubsw; VNNI: hi as two int8 parts, all three through vpdpbusd. All exact in int32; then one
// convert and one FMA per block pair by scale(w) * scale(x). Converting every weight to fp32
// instead cost ~13 cycles per block and capped a core at ~4.5-5 GB/s; this runs at ~12 GB/s per
// core with AVX2 and ~14.5 with VNNI (Zen 4). (Measured on the way: hi alone, 14 GB/s, but its
// 2^-16 error moved the tiny models' prefill-vs-decode logits by 6e-5 against 1e-7 before; hi +
// lo both int16 with sign-extended weights, 10 GB/s.)
// gemv, N >= 2 tokens, exact: per token the integer path costs ~15 operations per block pair
// against 8 FMAs once the block is in fp32, so each block is decoded to fp32 once and shared by up
// to 8 tokens.
// gemv, q8 (any N): x rounded to int8 per block, u8 x s8 dot products over 8 blocks per fp32 step
// (mxfp4_q8.h): the fused MoE layer's default (moe_cpu.cpp), the same bits per token.
// Every path computes a row whole on one thread, so the bits do not depend on the thread count.
// dequantize: the same decode to exact fp32, for the prefill path (dequantise + sgemm).
//
// Threads: the library's one pool (kernels/_cpu/pool.h); rows are handed out in chunks.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "mxfp4_q8.h"
#include "mxfp4_rows.h"
#include "pool.h"

namespace {

using localmoe::kChunkBytes;
using localmoe::parallel;

using namespace localmoe_mxfp4;

struct GemvArgs {
  const float* x;      // exact, N >= 2: x permuted per block
  const void* xq;      // exact, N = 1: the token's PairX records; q8: every token's GroupQ8 records
  int64_t N, K, O;
  const uint8_t* packed;
  const uint8_t* scales;
  float* y;
  bool q8;
};

void gemv_rows(const void* ctx, int64_t o0, int64_t o1) {
  const GemvArgs& a = *static_cast<const GemvArgs*>(ctx);
  const int64_t nb = a.K / kBlock, K = a.K;
  if (a.q8) {
    matrix_q8(a.packed, a.scales, K, o0, o1, static_cast<const GroupQ8*>(a.xq), a.N, a.y, a.O);
  } else if (a.N == 1) {
    matrix_token(a.packed, a.scales, K, o0, o1, static_cast<const PairX*>(a.xq), a.y);
  } else {
    for (int64_t o = o0; o < o1; ++o) row_tokens(a.packed + o * (K / 2), a.scales + o * nb, nb, a.x, a.N, K, a.y + o, a.O);
  }
}

struct DequantArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  float* w;
};

void dequantize_blocks(const void* ctx, int64_t b0, int64_t b1) {
  const DequantArgs& a = *static_cast<const DequantArgs*>(ctx);
  const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.packed + b * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // elements 0..15, 16..31
    const __m256 s = _mm256_set1_ps(kTables.half_scale[a.scales[b]]);
    float* dst = a.w + b * kBlock;
    _mm256_storeu_ps(dst, widen(first, s));
    _mm256_storeu_ps(dst + 8, widen(_mm_srli_si128(first, 8), s));
    _mm256_storeu_ps(dst + 16, widen(second, s));
    _mm256_storeu_ps(dst + 24, widen(_mm_srli_si128(second, 8), s));
  }
}

}  // namespace

extern "C" {

// Bytes of scratch mxfp4_gemv needs for N tokens of K (q8: 1 for q8 activations, 0 exact).
int64_t mxfp4_gemv_scratch(int64_t N, int64_t K, int q8) {
  if (q8) return N * q8_bytes(K) + 32;
  return N == 1 ? pairs_bytes(K) + 32 : N * K * static_cast<int64_t>(sizeof(float));
}

// y [N, O] fp32 = x [N, K] fp32 W^T; packed [O, K/2], scales [O, K/32]; K % 32 == 0; `scratch`
// holds mxfp4_gemv_scratch(N, K, q8) bytes. q8: x rounded to int8 per 32-element block first (the
// fused MoE layer's q8 path: the same bits per token). Rows are split over `threads` threads.
void mxfp4_gemv(const float* x, int64_t N, int64_t K, const uint8_t* packed, const uint8_t* scales, int64_t O,
                float* y, void* scratch, int threads, int q8) {
  const int64_t nb = K / kBlock;
  GemvArgs args{nullptr, nullptr, N, K, O, packed, scales, y, q8 != 0};
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch) + 31) & ~uintptr_t{31});  // 32 spare
  if (q8) {
    GroupQ8* xq = static_cast<GroupQ8*>(aligned);
    for (int64_t t = 0; t < N; ++t) quantize_row_q8(x + t * K, nb, xq + t * q8_groups(nb));
    args.xq = xq;
  } else if (N == 1) {
    PairX* xq = static_cast<PairX*>(aligned);
    quantize_row(x, nb, xq);
    args.xq = xq;
  } else {
    float* xp = static_cast<float*>(scratch);
    permute_blocks(x, N, K, xp);
    args.x = xp;
  }
  parallel(gemv_rows, &args, O, kChunkBytes / (K / 2 + nb), threads);
}

// packed [nblocks, 16], scales [nblocks] -> w [nblocks, 32] fp32, exact (-0 as +0), on `threads` threads.
void mxfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t nblocks, float* w, int threads) {
  const DequantArgs args{packed, scales, w};
  parallel(dequantize_blocks, &args, nblocks, kChunkBytes / 17, threads);
}

}  // extern "C"
