// Q6_K rows eight at a time ("rows8q6k"), against x rounded per 256 (BlockXK); included by ggml_rows.h after rows8k,
// whose kRunK it uses. Before session 9 a Q6_K row ran alone (Q6KInt8): eight fp32 lanes per row, one
// FMA chain per lane, summed across the lanes at the row's end. Now, per (row, token) and over the super-blocks in order,
//   acc = fma(float(S), d_w * d_x, acc)   with S = sum_i scale_i sum_{v in i} (q_v - 32) x_v
// the super-block's exact integer sum (|S| <= 256 * 32 * 127 * 128 < 2^31): one fp32 chain per row, as Q4_K / Q5_K's
// rows8k, the same in a group of eight, alone (a range's leftover rows), for one token or a tile, and on both ISAs.
//
// A row's super-block is decoded as before (q6_k_unsigned4: the four 32-value chunks that share a qh load, llama.cpp's
// masks), the unsigned codes (0..63) against x with vpmaddubsw (|pair| <= 2 * 63 * 127), each 16-value half's int8
// scale through vpmaddwd / vpdpwssd (madd_add), and the -32 as 32 sum_i scale_i sum(x_i) over x's 16-value sums:
// int32 lanes whose sum is S (q6k_lanes). Eight rows' lane vectors are then summed across lanes into one vector with a
// lane per row (seven vphaddd), converted, and one FMA by the eight rows' d (their fp16 at byte 208) times d_x serves
// all eight: the per-row conversion, FMA and final horizontal sum of the old form are gone. One token reads each row's
// run of super-blocks in order (eight rows a super-block at a time ran at ~0.5x from memory for Q4_K).
// A tile of tokens decodes a row's super-block once for all of them (as before); the rows' codes are not transposed.
#pragma once

namespace localmoe_ggml {

// Row `blk`'s super-block against TN tokens' (x[t][u]): lanes[t] holds int32 lanes whose sum is S above (exact).
template <int TN>
__attribute__((always_inline)) inline void q6k_lanes(const uint8_t* blk, const BlockXK* const* x, int64_t u,
                                                     __m256i* const* lanes) {
  constexpr int kChains = TN == 1 ? 2 : 1;  // a lone token's single vpdpwssd chain waited on its latency
  const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  // scales 0-7 and 8-15 in both 128-bit lanes; chunk c takes scale 2c in its low lane, 2c + 1 in its high one
  const __m256i halves[2] = {_mm256_permute2x128_si256(scales16, scales16, 0x00),
                             _mm256_permute2x128_si256(scales16, scales16, 0x11)};
  __m256i sum[TN][kChains];
#pragma GCC unroll 8
  for (int t = 0; t < TN; ++t) {  // -32 sum_i scale[i] sum(x_i), exact in int32
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t][u].sums16));
    sum[t][0] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(scales16, sums), 5));
    for (int c = 1; c < kChains; ++c) sum[t][c] = _mm256_setzero_si256();
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    q6_k_unsigned4(blk, h, q);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const int c = 4 * h + s;
      const char a = static_cast<char>(4 * c % 16), b = static_cast<char>((4 * c + 2) % 16);  // words 2c, 2c + 1
      const __m256i scale = _mm256_shuffle_epi8(halves[h], _mm256_setr_epi8(
          a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
          b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1));
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t][u].q + 32 * c));
        sum[t][c % kChains] = madd_add(sum[t][c % kChains], _mm256_maddubs_epi16(q[s], xq), scale);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TN; ++t) {
    for (int c = 1; c < kChains; ++c) sum[t][0] = _mm256_add_epi32(sum[t][0], sum[t][c]);
    *lanes[t] = sum[t][0];
  }
}

// Eight lane vectors s[0..7] -> one vector, lane r = the sum of s[r]'s lanes (exact int32).
__attribute__((always_inline)) inline __m256i across8(const __m256i* s) {
  // hadd(hadd(S0, S1), hadd(S2, S3)) = [S0 S1 S2 S3 low halves | high halves], likewise S4..S7
  const __m256i h03 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i h47 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20), _mm256_permute2x128_si256(h03, h47, 0x31));
}

// The fp16 d (byte 208 of a super-block) of eight rows' super-block `blk`, as fp32 lanes.
__attribute__((always_inline)) inline __m256 q6k_d8(const uint8_t* blk, int64_t stride) {
  uint16_t h[8];
  for (int r = 0; r < 8; ++r) std::memcpy(h + r, blk + r * stride + 208, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// Rows r .. r + 7 (Q6_K, rows of `stride` bytes, nsb super-blocks) against TN tokens (x[t]: token t's super-blocks):
// y[t * ldy + r ..] = the eight values (+ bias). Each row's super-blocks are read in order, up to kRunK at a time.
template <int TN>
inline void group8_q6k(const uint8_t* row0, int64_t stride, int64_t nsb, const BlockXK* const* x, float* y,
                       int64_t ldy, const float* bias) {
  constexpr int64_t kRun = TN == 1 ? kRunK : 1;
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t u0 = 0; u0 < nsb; u0 += kRun) {
    const int64_t n = std::min(kRun, nsb - u0);
    __m256i lanes[kRun][TN][8];
    for (int r = 0; r < 8; ++r) {  // no software prefetch: 16 rows ahead ran 0.9x from memory (the head's shape)
      for (int64_t k = 0; k < n; ++k) {
        __m256i* out[TN];
        for (int t = 0; t < TN; ++t) out[t] = &lanes[k][t][r];
        q6k_lanes<TN>(row0 + r * stride + (u0 + k) * 210, x, u0 + k, out);
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      const __m256 d = q6k_d8(row0 + (u0 + k) * 210, stride);
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const __m256 step = _mm256_mul_ps(d, _mm256_broadcast_ss(&x[t][u0 + k].d));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(across8(lanes[k][t])), step, acc[t]);
      }
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

// One row against one token: the chain group8_q6k gives that (row, token).
inline float q6k_row(const uint8_t* row, int64_t nsb, const BlockXK* x) {
  float acc = 0.0f;
  for (int64_t u = 0; u < nsb; ++u) {
    __m256i lanes;
    __m256i* out[1] = {&lanes};
    q6k_lanes<1>(row + u * 210, &x, u, out);
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    const __m128i s2 = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    acc = std::fma(static_cast<float>(total), half(row + u * 210 + 208) * x[u].d, acc);
  }
  return acc;
}

// rows8q6k as a group kernel for rows_fixed (ggml_rows.h).
struct Rows8K6 : NoWide {
  using X = BlockXK;
  static constexpr int kTile = kTileK8;
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nsb,
                                                   const BlockXK* const* x, float* y, int64_t ldy, const float* bias) {
    group8_q6k<TN>(row0, stride, nsb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nsb, const BlockXK* x) { return q6k_row(row, nsb, x); }
};

// Q6_K_R8 (kQ6_K_R8): Q6_K rows repacked at load (ggml_repack, ggml_cpu.cpp), eight at a time, into the bytes of
// vpdpbusd: eight rows' super-block u (the rows' 8 x 210 bytes, at the same place as in the GGUF layout: group g of
// rows 8g .. 8g + 7, super-block u at 8g * stride + 1680 u) is
//   bytes 0..15     the eight rows' fp16 d (row r at 2 r);
//   bytes 16..143   their int8 scales, dword k of row r (scales 4k .. 4k + 3) at 16 + 32 k + 4 r;
//   bytes 144..     per 16-value sub-block j, 96 bytes: three vectors A, B, C (at 144 + 96 j + 32 m, m = 0, 1, 2)
//                   whose lane r (bytes 4r .. 4r + 3) holds row r's unsigned codes q (0..63, w = d scale (q - 32)) of
//                   values 16 j + 4 m + b (b < 4) in bits 0-5 and bits 2m, 2m + 1 of the code of value 16 j + 12 + b
//                   in bits 6-7.
// So the 6 bits of 256 values take the bytes they took (ql, qh), and one token's sub-block costs three loads, eleven
// mask / shift / or operations for four code vectors (q6_k_unsigned4 took 17 for four 32-byte chunks of one row, then
// a scale shuffle per chunk, and the rows' lanes were summed across at the end: seven vphaddd per eight rows), four
// vpdpbusd against x's codes broadcast four at a time, and per sub-block the -32 (32 sum(x_j), subtracted) and the
// rows' scale j (vpmulld): lane r ends with row r's S of rows8q6k (the same exact integer), then the same one FMA per
// super-block: the bits of the GGUF layout's rows on every path. A matrix of a multiple of eight rows only.
constexpr int64_t kQ6R8Bytes = 8 * 210;

// Value v's unsigned code (0..63) in a GGUF-layout Q6_K super-block (q6_k_codes' positions); q6k_put ORs it in.
inline int q6k_code(const uint8_t* blk, int v) {
  const int c = v / 32, i = v % 32, h = c >> 2, s = c & 3;
  return ((blk[64 * h + 32 * (s & 1) + i] >> (s >= 2 ? 4 : 0)) & 0x0F) | ((blk[128 + 32 * h + i] >> (2 * s)) & 3) << 4;
}
inline void q6k_put(uint8_t* blk, int v, int code) {
  const int c = v / 32, i = v % 32, h = c >> 2, s = c & 3;
  blk[64 * h + 32 * (s & 1) + i] |= static_cast<uint8_t>((code & 0x0F) << (s >= 2 ? 4 : 0));
  blk[128 + 32 * h + i] |= static_cast<uint8_t>(((code >> 4) & 3) << (2 * s));
}

// Q6_K rows [O, nsb * 210] (O a multiple of 8) into Q6_K_R8 (`pack`) or back; src may be dst (one group at a time
// through `tmp`, 8 * nsb * 210 bytes).
inline void repack_q6k(const uint8_t* src, uint8_t* dst, int64_t O, int64_t nsb, bool pack, uint8_t* tmp) {
  const int64_t group = 8 * nsb * 210;
  for (int64_t g = 0; g < O / 8; ++g) {
    std::memcpy(tmp, src + g * group, group);
    uint8_t* out = dst + g * group;
    std::memset(out, 0, group);
    for (int r = 0; r < 8; ++r)
      for (int64_t u = 0; u < nsb; ++u) {
        uint8_t* plain = (pack ? tmp : out) + r * nsb * 210 + u * 210;
        uint8_t* packed = (pack ? out : tmp) + u * kQ6R8Bytes;
        if (pack) {
          std::memcpy(packed + 2 * r, plain + 208, 2);
          for (int k = 0; k < 4; ++k) std::memcpy(packed + 16 + 32 * k + 4 * r, plain + 192 + 4 * k, 4);
        } else {
          std::memcpy(plain + 208, packed + 2 * r, 2);
          for (int k = 0; k < 4; ++k) std::memcpy(plain + 192 + 4 * k, packed + 16 + 32 * k + 4 * r, 4);
        }
        for (int j = 0; j < 16; ++j)
          for (int b = 0; b < 4; ++b) {
            uint8_t* at = packed + 144 + 96 * j + 4 * r + b;  // + 32 m
            if (pack) {
              const int last = q6k_code(plain, 16 * j + 12 + b);
              for (int m = 0; m < 3; ++m)
                at[32 * m] = static_cast<uint8_t>(q6k_code(plain, 16 * j + 4 * m + b) | ((last >> (2 * m)) & 3) << 6);
            } else {
              int last = 0;
              for (int m = 0; m < 3; ++m) {
                q6k_put(plain, 16 * j + 4 * m + b, at[32 * m] & 0x3F);
                last |= (at[32 * m] >> 6) << (2 * m);
              }
              q6k_put(plain, 16 * j + 12 + b, last);
            }
          }
      }
  }
}

// Q6_K_R8 rows r .. r + 7 against TN tokens (x[t]: token t's super-blocks): y[t * ldy + r ..] = the eight values
// (+ bias), the bits of group8_q6k / q6k_row on the GGUF layout. The code vectors of a sub-block are made once for the
// tile; the bytes are read in order, one stream (no software prefetch, as Q4_K_R8).
template <int TN>
inline void group8_q6r8(const uint8_t* row0, int64_t, int64_t nsb, const BlockXK* const* x, float* y, int64_t ldy,
                        const float* bias) {
  const __m256i six = _mm256_set1_epi8(0x3F), m03 = _mm256_set1_epi8(0x03), m0c = _mm256_set1_epi8(0x0C),
                m30 = _mm256_set1_epi8(0x30);
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nsb; ++u) {
    const uint8_t* blk = row0 + u * kQ6R8Bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256i sc[4];
    for (int k = 0; k < 4; ++k) sc[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * k));
    alignas(32) int32_t off[TN][16];  // 32 sum(x_j): the -32 of each sub-block's codes
    __m256i sum[TN];
#pragma GCC unroll 8
    for (int t = 0; t < TN; ++t) {
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t][u].sums16));
      _mm256_store_si256(reinterpret_cast<__m256i*>(off[t]),
                         _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16)), 5));
      _mm256_store_si256(reinterpret_cast<__m256i*>(off[t] + 8),
                         _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16, 1)), 5));
      sum[t] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      const uint8_t* q = blk + 144 + 96 * j;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64));
      const __m256i codes[4] = {
          _mm256_and_si256(a, six), _mm256_and_si256(b, six), _mm256_and_si256(c, six),
          _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), m03),
                                          _mm256_and_si256(_mm256_srli_epi16(b, 4), m0c)),
                          _mm256_and_si256(_mm256_srli_epi16(c, 2), m30))};
      // the rows' int8 scale j, sign-extended in its lane
      const __m256i scale = _mm256_srai_epi32(_mm256_slli_epi32(sc[j / 4], 24 - 8 * (j % 4)), 24);
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const int8_t* xq = x[t][u].q + 16 * j;
        __m256i s0 = dot4_add(_mm256_setzero_si256(), codes[0], codes4(xq, 0));
        __m256i s1 = dot4_add(_mm256_setzero_si256(), codes[2], codes4(xq, 2));
        s0 = dot4_add(s0, codes[1], codes4(xq, 1));
        s1 = dot4_add(s1, codes[3], codes4(xq, 3));
        const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), _mm256_set1_epi32(off[t][j]));
        sum[t] = _mm256_add_epi32(sum[t], _mm256_mullo_epi32(s, scale));
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TN; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_broadcast_ss(&x[t][u].d)), acc[t]);
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

// Q6_K_R8 as a group kernel for rows_fixed.
struct Rows8K6R8 : WholeGroups<Rows8K6R8> {
  using X = BlockXK;
  static constexpr int kTile = kTileK8;
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nsb,
                                                   const BlockXK* const* x, float* y, int64_t ldy, const float* bias) {
    group8_q6r8<TN>(row0, stride, nsb, x, y, ldy, bias);
  }
};


}  // namespace localmoe_ggml
