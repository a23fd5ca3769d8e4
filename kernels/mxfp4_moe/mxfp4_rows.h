// MXFP4 row kernels (AVX2 + FMA) shared by the GEMV (mxfp4_cpu.cpp) and the fused MoE experts
// (moe_cpu.cpp): the activation formats and the dot product of one weight row with one or more
// tokens. How the integer path works and why: mxfp4_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace localmoe_mxfp4 {

using localmoe::hsum;

constexpr int64_t kBlock = 32;
// One token's activations per block pair (256 bytes): 64 int16 high parts, 64 int8 low parts,
// 8 int32 bias corrections and 8 fp32 scales [s(b) x4, s(b+1) x4]; see quantize_row.
struct alignas(32) PairX {
  int16_t hi[64];
  int8_t lo[64];
  int32_t bias[8];
  float scale[8];
};

struct Tables {
  float half_scale[256];  // scale byte b -> 2^(b - 127) / 2 (the code LUT holds twice the value); 0xFF -> NaN
  Tables() {
    for (int b = 0; b < 255; ++b) half_scale[b] = std::ldexp(1.0f, b - 128);
    half_scale[255] = std::nanf("");
  }
};
const Tables kTables;

// 2 * e2m1(code), exact in int8; bit 3 is the sign (code 8 = -0 decodes as +0).
inline __m128i code_lut() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

inline __m256 widen(__m128i v, __m256 s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s); }

// One token: x [K] fp32 -> xq [npairs] (a missing odd last block is all zeros). Per block, with
// step = amax / 32767: x = step / 256 * (256 * hi + lo) + err, hi int16, lo int8, |err| <= step / 256
// (~2^-23 of the block's largest magnitude: about fp32's own rounding of that element). The
// weights are decoded as u8 w + 12 (w = 2 * e2m1 in [-12, 12]), so lane j of block h needs
// bias[4h + j] = 12 * sum(256 * hi + lo) over the 8 elements it sums (8j .. 8j + 7).
// Layouts (lane h = block h): int16 hi[16 * c + 8 * h + k] holds element 4k + (0, 2, 1, 3)[c];
// int8 lo[32 * c + 16 * h + i] holds element 2i + c. A block holding NaN or Inf gets scale NaN.
inline void quantize_row(const float* x, int64_t nb, PairX* xq) {
  std::memset(static_cast<void*>(xq), 0, (nb + 1) / 2 * sizeof(PairX));
  constexpr int kHiPart[4] = {0, 2, 1, 3};  // element 4k + e%4 -> which of the 4 int16 vectors
  alignas(32) int32_t q[kBlock], r[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    const __m256* v = blk.v;
    const float top = blk.top;
    const bool finite = blk.finite;
    PairX& px = xq[b / 2];
    const int h = static_cast<int>(b & 1);
    const float step = top / 32767.0f;
    for (int j = 0; j < 4; ++j) px.scale[4 * h + j] = finite ? step / 256.0f : std::nanf("");
    if (!finite || top == 0.0f) continue;
    const __m256 vstep = _mm256_set1_ps(step), inv = _mm256_set1_ps(32767.0f / top);
    const __m256 inv_lo = _mm256_mul_ps(inv, _mm256_set1_ps(256.0f));
    for (int j = 0; j < 4; ++j) {
      const __m256 hi = _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 res = _mm256_fnmadd_ps(hi, vstep, v[j]);  // x - hi * step, one rounding
      const __m256 lo = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(res, inv_lo), _mm256_set1_ps(-128.0f)),
                                      _mm256_set1_ps(127.0f));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), _mm256_cvtps_epi32(hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * j), _mm256_cvtps_epi32(lo));
    }
    for (int e = 0; e < kBlock; ++e) {
      const int32_t hi = std::min(std::max(q[e], -32767), 32767);
      px.hi[16 * kHiPart[e % 4] + 8 * h + e / 4] = static_cast<int16_t>(hi);
      px.lo[32 * (e % 2) + 16 * h + e / 2] = static_cast<int8_t>(r[e]);
      px.bias[4 * h + e / 8] += 12 * (256 * hi + r[e]);
    }
  }
}

// Block pair p of one weight row (q: its 32 code bytes, lane h = block 2p + h; s0, s1: the blocks'
// half scales) against one token's activations: acc + the pair's 8 lane partial dots.
inline __m256 pair_dot(__m256i q, float s0, float s1, const PairX& x, __m256 acc) {
  // 2 * e2m1(code) + 12 as u8 (bit 3 is the sign; code 8 = -0 decodes as +0)
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i nibble = _mm256_set1_epi8(0x0F), low_byte = _mm256_set1_epi16(0x00FF), ones = _mm256_set1_epi16(1);
  const __m256i ev = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, nibble));                      // elements 2i
  const __m256i od = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble));  // 2i + 1
  const __m256i* hi = reinterpret_cast<const __m256i*>(x.hi);
  const __m256i* lo = reinterpret_cast<const __m256i*>(x.lo);
  // high parts: the u8 weights zero-extended in place to int16 (elements 4k, 4k + 2 | 4k + 1, 4k + 3)
  const __m256i h0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(ev, low_byte), _mm256_load_si256(hi)),
                                      _mm256_madd_epi16(_mm256_srli_epi16(ev, 8), _mm256_load_si256(hi + 1)));
  const __m256i h1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(od, low_byte), _mm256_load_si256(hi + 2)),
                                      _mm256_madd_epi16(_mm256_srli_epi16(od, 8), _mm256_load_si256(hi + 3)));
  // low parts: u8 weights x s8 activations (|pair| <= 2 * 24 * 128, no saturation)
  const __m256i l16 = _mm256_add_epi16(_mm256_maddubs_epi16(ev, _mm256_load_si256(lo)),
                                       _mm256_maddubs_epi16(od, _mm256_load_si256(lo + 1)));
  // 256 * hi + lo - bias: |256 * h| <= 8 * 24 * 32767 * 256 < 2^31, exact in int32
  __m256i d = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(h0, h1), 8), _mm256_madd_epi16(l16, ones));
  d = _mm256_sub_epi32(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.bias)));
  const __m256 ws = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, _mm256_load_ps(x.scale)), acc);
}

// One token against one weight row (the N = 1 path).
inline float row_int(const uint8_t* prow, const uint8_t* srow, int64_t nb, const PairX* xq) {
  const float* hs = kTables.half_scale;
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; 2 * p + 2 <= nb; ++p) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prow + p * 32));
    if ((p & 1) == 0)  // one line per 64 bytes, 1 KiB ahead: +10-15 % over the hardware prefetcher alone
      _mm_prefetch(reinterpret_cast<const char*>(prow + p * 32 + 1024), _MM_HINT_T0);
    acc = pair_dot(q, hs[srow[2 * p]], hs[srow[2 * p + 1]], xq[p], acc);
  }
  if (2 * p < nb) {  // odd last block: the other lane decodes code 0 against zero activations, scale 0
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + p * 32));
    acc = pair_dot(_mm256_zextsi128_si256(q), hs[srow[2 * p]], 0.0f, xq[p], acc);
  }
  return hsum(acc);
}

// NT tokens of fp32 x (permuted per block to [x0, x2, .., x30, x1, x3, .., x31], row stride K)
// against one weight row, the N >= 2 path: each block is decoded to fp32 once and shared by the
// tokens' FMAs (8 per block pair and token, against ~19 integer operations for the path above).
// NT <= 2: each block's unscaled dot first, then one FMA by its scale. Writes y[t * O].
template <int NT>
inline void row_f32(const uint8_t* prow, const uint8_t* srow, int64_t nb, const float* xp, int64_t K, float* y,
                    int64_t O) {
  const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
  constexpr bool kDotFirst = NT <= 2;
  constexpr int NA = kDotFirst ? 2 : (NT <= 4 ? 2 : 1);
  __m256 acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + b * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const __m256 s = _mm256_set1_ps(kTables.half_scale[srow[b]]);
    const __m256 one = kDotFirst ? _mm256_set1_ps(1.0f) : s;
    const __m256 w[4] = {widen(lo, one), widen(_mm_srli_si128(lo, 8), one), widen(hi, one),
                         widen(_mm_srli_si128(hi, 8), one)};
    for (int t = 0; t < NT; ++t) {
      const float* xb = xp + t * K + b * kBlock;
      if (kDotFirst) {
        const __m256 d0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xb)));
        const __m256 d1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(xb + 16)));
        acc[t][b & 1] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), s, acc[t][b & 1]);
      } else {
        for (int j = 0; j < 4; ++j) acc[t][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[t][j % NA]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 sum = acc[t][0];
    for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
    y[t * O] = hsum(sum);
  }
}

// Permutes N rows of x [N, K] per 32-element block to [x0, x2, .., x30, x1, x3, .., x31] (row_f32's order).
inline void permute_blocks(const float* x, int64_t N, int64_t K, float* xp) {
  for (int64_t i = 0; i < N * K; i += kBlock)
    for (int j = 0; j < 16; ++j) {
      xp[i + j] = x[i + 2 * j];
      xp[i + 16 + j] = x[i + 2 * j + 1];
    }
}

// N >= 2 tokens (xp: permuted, row stride K) against weight row (prow, srow): y[t * O] for each token,
// in groups of 8, 4, 2 and 1 tokens.
inline void row_tokens(const uint8_t* prow, const uint8_t* srow, int64_t nb, const float* xp, int64_t N, int64_t K,
                       float* y, int64_t O) {
  int64_t t = 0;
  for (; t + 8 <= N; t += 8) row_f32<8>(prow, srow, nb, xp + t * K, K, y + t * O, O);
  if (N - t >= 4) {
    row_f32<4>(prow, srow, nb, xp + t * K, K, y + t * O, O);
    t += 4;
  }
  if (N - t >= 2) {
    row_f32<2>(prow, srow, nb, xp + t * K, K, y + t * O, O);
    t += 2;
  }
  if (N - t >= 1) row_f32<1>(prow, srow, nb, xp + t * K, K, y + t * O, O);
}

// ---- q8 activations (EngineConfig.expert_precision "q8"): llama.cpp's trade, kept per token ----
// One token's activations per block pair (128 bytes): 64 int8 on a grid of amax / 127 per block
// (|error| <= half a step, ~2^-8 of the block's largest magnitude: the order of bf16 activations),
// 8 int32 bias corrections and 8 fp32 scales [d(b) x4, d(b+1) x4]. Layout: q[32 * c + 16 * h + i]
// holds element 2i + c of block h (the even/odd code nibbles of pair_dot); bias[4h + j] = 12 *
// sum(q) over elements 8j .. 8j + 7 of block h (the weights are decoded as u8 w + 12, as above).
struct alignas(32) PairQ8 {
  int8_t q[64];
  int32_t bias[8];
  float scale[8];
};

// One token: x [K] fp32 -> xq [npairs] (a missing odd last block is all zeros). q = round(x * 127 /
// amax) to nearest even, d = amax / 127 (both in fp32: reference.q8_round rounds the same way). A
// block holding NaN or Inf gets scale NaN.
inline void quantize_row_q8(const float* x, int64_t nb, PairQ8* xq) {
  std::memset(static_cast<void*>(xq), 0, (nb + 1) / 2 * sizeof(PairQ8));
  alignas(32) int32_t q[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    const __m256* v = blk.v;
    const float top = blk.top;
    const bool finite = blk.finite;
    PairQ8& px = xq[b / 2];
    const int h = static_cast<int>(b & 1);
    for (int j = 0; j < 4; ++j) px.scale[4 * h + j] = finite ? top / 127.0f : std::nanf("");
    if (!finite || top == 0.0f) continue;
    const __m256 inv = _mm256_set1_ps(127.0f / top);
    for (int j = 0; j < 4; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), localmoe::round_scaled(v[j], inv));
    for (int e = 0; e < kBlock; ++e) {
      px.q[32 * (e % 2) + 16 * h + e / 2] = static_cast<int8_t>(q[e]);  // |q| <= 127 by construction
      px.bias[4 * h + e / 8] += 12 * q[e];
    }
  }
}

// A decoded block pair: even/odd elements as u8 (2 * e2m1 + 12) and the weights' scales [s0 x4, s1 x4].
struct PairW {
  __m256i ev, od;
  __m256 scale;
};

inline PairW decode_pair(__m256i q, float s0, float s1) {
  const __m256i lut =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  return PairW{_mm256_shuffle_epi8(lut, _mm256_and_si256(q, nibble)),
               _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble)),
               _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0))};
}

// acc + the pair's 8 lane partial dots with one token: u8 x s8 pairs (|pair| <= 2 * 24 * 127, two
// summed < 2^15, no saturation), summed to int32 per 8 elements, less the +12 correction.
inline __m256 pair_dot_q8(const PairW& w, const PairQ8& x, __m256 acc) {
  const __m256i* q = reinterpret_cast<const __m256i*>(x.q);
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.ev, _mm256_load_si256(q)),
                                       _mm256_maddubs_epi16(w.od, _mm256_load_si256(q + 1)));
  const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)),
                                     _mm256_load_si256(reinterpret_cast<const __m256i*>(x.bias)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(w.scale, _mm256_load_ps(x.scale)), acc);
}

// NT tokens' q8 records (record stride `stride` pairs) against one weight row: each pair decoded
// once, then per token the same operations in the same order as NT = 1, so a token's bits do not
// depend on how many tokens share the call. Writes y[t * O].
template <int NT>
inline void row_q8(const uint8_t* prow, const uint8_t* srow, int64_t nb, const PairQ8* xq, int64_t stride, float* y,
                   int64_t O) {
  const float* hs = kTables.half_scale;
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  int64_t p = 0;
  for (; 2 * p + 2 <= nb; ++p) {
    if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(prow + p * 32 + 1024), _MM_HINT_T0);
    const PairW w = decode_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(prow + p * 32)),
                                hs[srow[2 * p]], hs[srow[2 * p + 1]]);
    for (int t = 0; t < NT; ++t) acc[t] = pair_dot_q8(w, xq[t * stride + p], acc[t]);
  }
  if (2 * p < nb) {  // odd last block: the other lane decodes code 0 against zero activations, scale 0
    const __m128i last = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + p * 32));
    const PairW w = decode_pair(_mm256_zextsi128_si256(last), hs[srow[2 * p]], 0.0f);
    for (int t = 0; t < NT; ++t) acc[t] = pair_dot_q8(w, xq[t * stride + p], acc[t]);
  }
  for (int t = 0; t < NT; ++t) y[t * O] = hsum(acc[t]);
}

// N >= 1 tokens' q8 records against one weight row, in groups of 4, 2 and 1 tokens.
inline void row_q8_tokens(const uint8_t* prow, const uint8_t* srow, int64_t nb, const PairQ8* xq, int64_t stride,
                          int64_t N, float* y, int64_t O) {
  int64_t t = 0;
  for (; t + 4 <= N; t += 4) row_q8<4>(prow, srow, nb, xq + t * stride, stride, y + t * O, O);
  if (N - t >= 2) {
    row_q8<2>(prow, srow, nb, xq + t * stride, stride, y + t * O, O);
    t += 2;
  }
  if (N - t >= 1) row_q8<1>(prow, srow, nb, xq + t * stride, stride, y + t * O, O);
}

inline int64_t pairs_q8_bytes(int64_t K) { return (K / kBlock + 1) / 2 * static_cast<int64_t>(sizeof(PairQ8)); }

// Bytes of one token's integer parts for K inputs (row_int's PairX records).
inline int64_t pairs_bytes(int64_t K) { return (K / kBlock + 1) / 2 * static_cast<int64_t>(sizeof(PairX)); }

}  // namespace localmoe_mxfp4
