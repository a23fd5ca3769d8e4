// MXFP4 row kernels shared by the GEMV (mxfp4_cpu.cpp) and the fused MoE experts (moe_cpu.cpp):
// the activation formats and the dot product of weight rows with one or more tokens. How the
// integer path works and why: mxfp4_cpu.cpp's header comment.
//
// Two instruction sets from this one source (kernels/_cpu builds a library per ISA): AVX2 + FMA,
// and with AVX-512 VNNI (LOCALMOE_VNNI) the u8 x s8 dot products run as vpdpbusd on 256-bit
// vectors. Both compute the same int32 sums per lane and then the same fp32 operations in the same
// order, so a row's result has the same bits on either.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LOCALMOE_VNNI 1
#endif

namespace localmoe_mxfp4 {

using localmoe::hsum;

constexpr int64_t kBlock = 32;
// The exact path's grid: |hi| <= 127 * 257, so that hi = 256 * hh + hm with hh and hm both int8
// (the VNNI layout below); 2^-15 of a block's largest value, as with int16's full range.
constexpr int32_t kHiMax = 32639;
// One token's activations per block pair (256 bytes) for the exact path: the high parts hi and the
// low parts lo (int8), 8 int32 bias corrections and 8 fp32 scales [s(b) x4, s(b+1) x4]; see
// quantize_row. AVX2 holds hi as int16 (read by vpmaddwd); VNNI as two int8 parts hh, hm (read by
// vpdpbusd like lo).
struct alignas(32) PairX {
#ifdef LOCALMOE_VNNI
  int8_t hh[64];
  int8_t hm[64];
#else
  int16_t hi[64];
#endif
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
// step = amax / kHiMax: x = step / 256 * (256 * hi + lo) + err, |hi| <= kHiMax, lo int8, |err| <=
// step / 256 (~2^-23 of the block's largest magnitude: about fp32's own rounding of that element).
// The weights are decoded as u8 w + 12 (w = 2 * e2m1 in [-12, 12]), so lane j of block h needs
// bias[4h + j] = 12 * sum(256 * hi + lo) over the 8 elements it sums (8j .. 8j + 7).
// Layouts (lane h = block h): int8 lo[32 * c + 16 * h + i] holds element 2i + c (the even/odd code
// nibbles of decode_pair), and so do hh and hm (VNNI: hi = 256 * hh + hm, hm in [-128, 127]); AVX2's
// int16 hi[16 * c + 8 * h + k] holds element 4k + (0, 2, 1, 3)[c]. A block holding NaN or Inf gets
// scale NaN.
inline void quantize_row(const float* x, int64_t nb, PairX* xq) {
  std::memset(static_cast<void*>(xq), 0, (nb + 1) / 2 * sizeof(PairX));
  alignas(32) int32_t q[kBlock], r[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    const __m256* v = blk.v;
    const float top = blk.top;
    const bool finite = blk.finite;
    PairX& px = xq[b / 2];
    const int h = static_cast<int>(b & 1);
    const float step = top / static_cast<float>(kHiMax);
    for (int j = 0; j < 4; ++j) px.scale[4 * h + j] = finite ? step / 256.0f : std::nanf("");
    if (!finite || top == 0.0f) continue;
    const __m256 vstep = _mm256_set1_ps(step), inv = _mm256_set1_ps(static_cast<float>(kHiMax) / top);
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
      const int32_t hi = std::min(std::max(q[e], -kHiMax), kHiMax);
      const int lane = 32 * (e % 2) + 16 * h + e / 2;
#ifdef LOCALMOE_VNNI
      const int32_t hh = (hi + 128) >> 8;  // floor: hm = hi - 256 * hh in [-128, 127], |hh| <= 127
      px.hh[lane] = static_cast<int8_t>(hh);
      px.hm[lane] = static_cast<int8_t>(hi - 256 * hh);
#else
      constexpr int kHiPart[4] = {0, 2, 1, 3};  // element 4k + e%4 -> which of the 4 int16 vectors
      px.hi[16 * kHiPart[e % 4] + 8 * h + e / 4] = static_cast<int16_t>(hi);
#endif
      px.lo[lane] = static_cast<int8_t>(r[e]);
      px.bias[4 * h + e / 8] += 12 * (256 * hi + r[e]);
    }
  }
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

// A decoded block pair: even/odd elements as u8 (2 * e2m1 + 12) and the weights' scales [s0 x4, s1 x4].
struct PairW {
  __m256i ev, od;
  __m256 scale;
};

inline PairW decode_pair(__m256i q, __m256 scale) {
  const __m256i lut =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  return PairW{_mm256_shuffle_epi8(lut, _mm256_and_si256(q, nibble)),
               _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble)), scale};
}

// A block pair's weight scales as PairW holds them: [s0 x4, s1 x4].
inline __m256 pair_scales(float s0, float s1) { return _mm256_blend_ps(_mm256_set1_ps(s0), _mm256_set1_ps(s1), 0xF0); }

// The pair's 8 int32 lane dots (lane 4h + j: elements 8j .. 8j + 7 of block h) with one token's
// exact records, less the +12 correction: 256 * (w . hi) + w . lo, exact in int32 (|256 * w . hi|
// <= 8 * 24 * kHiMax * 256 < 2^31).
inline __m256i pair_int(const PairW& w, const PairX& x) {
  const __m256i* lo = reinterpret_cast<const __m256i*>(x.lo);
#ifdef LOCALMOE_VNNI
  // hi = 256 * hh + hm: ((w . hh) * 256 + w . hm) * 256 + w . lo, six u8 x s8 dot products
  const __m256i* hh = reinterpret_cast<const __m256i*>(x.hh);
  const __m256i* hm = reinterpret_cast<const __m256i*>(x.hm);
  __m256i d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.ev, _mm256_load_si256(hh)), w.od,
                                  _mm256_load_si256(hh + 1));
  d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(d, 8), w.ev, _mm256_load_si256(hm)), w.od,
                          _mm256_load_si256(hm + 1));
  d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(d, 8), w.ev, _mm256_load_si256(lo)), w.od,
                          _mm256_load_si256(lo + 1));
#else
  const __m256i low_byte = _mm256_set1_epi16(0x00FF), ones = _mm256_set1_epi16(1);
  const __m256i* hi = reinterpret_cast<const __m256i*>(x.hi);
  // high parts: the u8 weights zero-extended in place to int16 (elements 4k, 4k + 2 | 4k + 1, 4k + 3)
  const __m256i h0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(w.ev, low_byte), _mm256_load_si256(hi)),
                                      _mm256_madd_epi16(_mm256_srli_epi16(w.ev, 8), _mm256_load_si256(hi + 1)));
  const __m256i h1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(w.od, low_byte), _mm256_load_si256(hi + 2)),
                                      _mm256_madd_epi16(_mm256_srli_epi16(w.od, 8), _mm256_load_si256(hi + 3)));
  // low parts: u8 weights x s8 activations (|pair| <= 2 * 24 * 128, no saturation)
  const __m256i l16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.ev, _mm256_load_si256(lo)),
                                       _mm256_maddubs_epi16(w.od, _mm256_load_si256(lo + 1)));
  const __m256i d = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(h0, h1), 8), _mm256_madd_epi16(l16, ones));
#endif
  return _mm256_sub_epi32(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.bias)));
}

// acc + the pair's 8 lane partial dots with one token's exact records, scaled by the weights'
// scale times the activations'.
inline __m256 pair_fma(const PairW& w, const PairX& x, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_int(w, x)), _mm256_mul_ps(w.scale, _mm256_load_ps(x.scale)), acc);
}

// Block pair p of a row (codes prow) with its weight scales [s0 x4, s1 x4], whole: one line
// prefetched per 64 bytes, 1 KiB ahead (+10-15 % over the hardware prefetcher alone).
inline PairW row_pair(const uint8_t* prow, int64_t p, __m256 scale) {
  if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(prow + p * 32 + 1024), _MM_HINT_T0);
  return decode_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(prow + p * 32)), scale);
}

// The same with the scales looked up from the row's scale bytes srow.
inline PairW row_pair(const uint8_t* prow, const uint8_t* srow, int64_t p) {
  return row_pair(prow, p, pair_scales(kTables.half_scale[srow[2 * p]], kTables.half_scale[srow[2 * p + 1]]));
}

// The odd last block p of a row: the other lane decodes code 0 against zero activations, scale 0.
inline PairW row_last_block(const uint8_t* prow, const uint8_t* srow, int64_t p) {
  const __m128i last = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prow + p * 32));
  return decode_pair(_mm256_zextsi128_si256(last), pair_scales(kTables.half_scale[srow[2 * p]], 0.0f));
}

// The half scales of 16 ordinary scale bytes (1..254) without the table, into two vectors of 8
// (blocks 0-7, 8-15): 2^(b - 128) is the float with exponent field b - 1. False where a byte is 0
// (2^-128, subnormal) or 0xFF (NaN): those take the table.
inline bool half_scales16(const uint8_t* s, __m256 out[2]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i special = _mm_or_si128(_mm_cmpeq_epi8(b, _mm_setzero_si128()), _mm_cmpeq_epi8(b, _mm_set1_epi8(-1)));
  if (_mm_movemask_epi8(special) != 0) return false;
  const __m256i one = _mm256_set1_epi32(1);
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), one), 23));
  out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), one), 23));
  return true;
}

// Pair j (0..7) of a run's scales as PairW holds them, from half_scales16's two vectors.
inline __m256 run_pair_scales(const __m256 half[2], int j) {
  const int a = 2 * (j % 4);
  return _mm256_permutevar8x32_ps(half[j / 4], _mm256_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1));
}

// Rows [o0, o1) of a matrix (packed [O, K/2], scales [O, K/32]) against one token's records x
// (PairX): y[o]. Per run of 8 block pairs, the 16 scales come from one load (half_scales16),
// not 16 table lookups: the path is bound by loads as much as by arithmetic (+25 % for the exact
// path with VNNI; the same bits either way, the scales being exact powers of two). One row at a
// time: computing 2-4 rows together shares the loads of x and ran 7-10 % faster from L2, but
// streaming from memory 15-40 % slower (Zen 4: the interleaved rows' streams defeat the prefetchers).
inline void matrix_token(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t o0, int64_t o1, const PairX* x,
                         float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* prow = packed + o * (K / 2);
    const uint8_t* srow = scales + o * nb;
    __m256 acc = _mm256_setzero_ps();
    int64_t p = 0;
    for (; 2 * p + 16 <= nb; p += 8) {
      __m256 half[2];
      if (!half_scales16(srow + 2 * p, half)) {
        for (int j = 0; j < 8; ++j) acc = pair_fma(row_pair(prow, srow, p + j), x[p + j], acc);
        continue;
      }
      for (int j = 0; j < 8; ++j)
        acc = pair_fma(row_pair(prow, p + j, run_pair_scales(half, j)), x[p + j], acc);
    }
    for (; 2 * p + 2 <= nb; ++p) acc = pair_fma(row_pair(prow, srow, p), x[p], acc);
    if (2 * p < nb) acc = pair_fma(row_last_block(prow, srow, p), x[p], acc);
    y[o] = hsum(acc);
  }
}

// Bytes of one token's exact records for K inputs (PairX).
inline int64_t pairs_bytes(int64_t K) { return (K / kBlock + 1) / 2 * static_cast<int64_t>(sizeof(PairX)); }

}  // namespace localmoe_mxfp4
