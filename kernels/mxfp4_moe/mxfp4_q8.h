// MXFP4 weight rows against q8 activations (EngineConfig.expert_precision "q8", llama.cpp's trade): the
// GEMV's q8 path (mxfp4_cpu.cpp) and the fused MoE experts' (moe_cpu.cpp), for one token or several.
//
// Activations are rounded to int8 per 32-value block (q = round(x * 127 / amax) to nearest even, d =
// amax / 127: reference.q8_round rounds the same way) and kept per token in groups of 8 blocks
// (GroupQ8). A row's 8 blocks (128 code bytes) are loaded as 4 pairs of blocks, transposed by dwords
// so that int32 lane l of every vector holds block kLaneBlock[l] (the transpose is per row, shared by
// all the tokens of a call), and decoded to u8 weights + 12. Per token the 8 u8 x s8 dot products
// (vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2) sum each block whole in one lane,
// exactly in int32, starting from the token's -12 * sum(q) (the +12 correction); then one fp32 step
// per 8 blocks: acc += float(sum) * (weight scale * activation scale), a power of two times d, so
// the product is exact. Against one fp32 step per 2 blocks (the former PairQ8 form) that is a quarter
// of the conversions and multiplies per token: 1.2-1.6x at 2-6 tokens per row, Zen 4.
//
// Bits: per (row, token) the integer sums are exact and the fp32 steps run in group order with the
// same operations on both instruction sets, whatever the number of tokens or rows in the call: a
// token's result is the same alone or batched (prefill = decode), AVX2 == AVX-512.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "mxfp4_rows.h"
#include "vec_math.h"

namespace localmoe_mxfp4 {

// One token's q8 activations for 8 blocks (256 values, 320 bytes). Lane l holds block kLaneBlock[l]:
// q[2m + c][4l + i] = element 8m + 2i + c of that block (m: the block's code dword, c: low / high
// nibble), neg_bias[l] = -12 * the block's sum of q, scale[l] = its d. A block past the row's end is
// all zeros (scale 0); a block holding NaN or Inf gets scale NaN.
struct alignas(32) GroupQ8 {
  int8_t q[8][32];
  int32_t neg_bias[8];
  float scale[8];
};
constexpr int kLaneBlock[8] = {0, 2, 4, 6, 1, 3, 5, 7};

inline int64_t q8_groups(int64_t nb) { return (nb + 7) / 8; }

// Bytes of one token's q8 records for K inputs.
inline int64_t q8_bytes(int64_t K) { return q8_groups(K / kBlock) * static_cast<int64_t>(sizeof(GroupQ8)); }

// One token: x [nb * 32] fp32 -> xq [q8_groups(nb)].
inline void quantize_row_q8(const float* x, int64_t nb, GroupQ8* xq) {
  std::memset(static_cast<void*>(xq), 0, q8_groups(nb) * sizeof(GroupQ8));
  alignas(32) int32_t q[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    GroupQ8& g = xq[b / 8];
    const int lane = static_cast<int>(b % 2) * 4 + static_cast<int>(b % 8) / 2;  // kLaneBlock[lane] == b % 8
    g.scale[lane] = blk.finite ? blk.top / 127.0f : std::nanf("");
    if (!blk.finite || blk.top == 0.0f) continue;
    const __m256 inv = _mm256_set1_ps(127.0f / blk.top);
    for (int j = 0; j < 4; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), localmoe::round_scaled(blk.v[j], inv));
    int32_t sum = 0;
    for (int e = 0; e < kBlock; ++e) {  // |q| <= 127 by construction
      g.q[2 * (e / 8) + e % 2][4 * lane + (e % 8) / 2] = static_cast<int8_t>(q[e]);
      sum += q[e];
    }
    g.neg_bias[lane] = -12 * sum;
  }
}

// A row's 8 blocks decoded: w[2m + c] as the records' q[2m + c], u8 (2 * e2m1 + 12); their half
// scales per lane.
struct GroupW {
  __m256i w[8];
  __m256 scale;
};

// 4 pairs of blocks (p[k]: blocks 2k, 2k + 1, 16 code bytes each) -> GroupW.
__attribute__((always_inline)) inline GroupW decode_group(const __m256i p[4], __m256 scale) {
  const __m256i t0 = _mm256_unpacklo_epi32(p[0], p[1]), t1 = _mm256_unpackhi_epi32(p[0], p[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(p[2], p[3]), t3 = _mm256_unpackhi_epi32(p[2], p[3]);
  const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                        _mm256_unpackhi_epi64(t1, t3)};  // v[m] lane l: dword m of block kLaneBlock[l]
  const __m256i lut =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  GroupW g;
  for (int m = 0; m < 4; ++m) {
    g.w[2 * m] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v[m], nibble));
    g.w[2 * m + 1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v[m], 4), nibble));
  }
  g.scale = scale;
  return g;
}

// Half scales of scale bytes s[0..n) in lane order, 0 for the lanes of blocks >= n, by the table.
inline __m256 group_scales_table(const uint8_t* s, int64_t n) {
  alignas(32) float v[8];
  for (int l = 0; l < 8; ++l) v[l] = kLaneBlock[l] < n ? kTables.half_scale[s[kLaneBlock[l]]] : 0.0f;
  return _mm256_load_ps(v);
}

// The same for 8 blocks: 2^(b - 128) is the float with exponent field b - 1 (the table where a byte is
// 0 or 0xFF: subnormal, NaN).
__attribute__((always_inline)) inline __m256 group_scales(const uint8_t* s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m128i special = _mm_or_si128(_mm_cmpeq_epi8(b, _mm_setzero_si128()), _mm_cmpeq_epi8(b, _mm_set1_epi8(-1)));
  if ((_mm_movemask_epi8(special) & 0xFF) != 0) return group_scales_table(s, 8);
  const __m128i lanes = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1));
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lanes), _mm256_set1_epi32(1)), 23));
}

// Group g (blocks 8g .. 8g + 7) of a row: codes prow, scales bytes srow; the lines kPrefetch bytes ahead
// prefetched (at 1 KiB, 1.17x slower: a decode token's experts come from RAM in short runs).
constexpr int64_t kPrefetch = 2048;
__attribute__((always_inline)) inline GroupW row_group(const uint8_t* prow, const uint8_t* srow, int64_t g) {
  const uint8_t* c = prow + g * 128;
  _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64), _MM_HINT_T0);
  const __m256i p[4] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 96))};
  return decode_group(p, group_scales(srow + g * 8));
}

// The half scales of a row's last n < 8 blocks (after g >= 1 whole groups), as group_scales_table(srow + 8 g, n)
// gives them: the row's last 8 scale bytes in one load (still inside the row), shifted down to the n wanted,
// the lanes of the missing blocks 0; the table where one of the n is 0 or 0xFF.
__attribute__((always_inline)) inline __m256 tail_scales(const uint8_t* srow, int64_t g, int64_t n) {
  uint64_t bytes;
  std::memcpy(&bytes, srow + 8 * g + n - 8, 8);
  const __m128i b = _mm_cvtsi64_si128(static_cast<long long>(bytes >> (8 * (8 - n))));
  const __m128i special = _mm_or_si128(_mm_cmpeq_epi8(b, _mm_setzero_si128()), _mm_cmpeq_epi8(b, _mm_set1_epi8(-1)));
  if ((_mm_movemask_epi8(special) & ((1 << n) - 1)) != 0) return group_scales_table(srow + 8 * g, n);
  const __m128i lanes = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i scale = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lanes), _mm256_set1_epi32(1)), 23);
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  return _mm256_castsi256_ps(_mm256_and_si256(scale, live));  // kLaneBlock[l] < n
}

// The row's last group when it has n < 8 blocks: nothing read past the row, the missing blocks code 0
// with scale 0 (against all-zero activations: exactly 0).
__attribute__((always_inline)) inline GroupW row_last_group(const uint8_t* prow, const uint8_t* srow, int64_t g,
                                                            int64_t n) {
  const uint8_t* c = prow + g * 128;
  __m256i p[4];
  for (int k = 0; k < 4; ++k) {
    const int64_t blocks = n - 2 * k;
    p[k] = blocks >= 2   ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * k))
           : blocks == 1 ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * k)))
                         : _mm256_setzero_si256();
  }
  return decode_group(p, g > 0 ? tail_scales(srow, g, n) : group_scales_table(srow, n));
}

// The group's 8 int32 lane sums with one token (lane l: block kLaneBlock[l], whole), less the +12
// correction: two chains of 4 (independent in flight), exact in int32.
__attribute__((always_inline)) inline __m256i group_int(const GroupW& w, const GroupQ8& x) {
  const __m256i* q = reinterpret_cast<const __m256i*>(x.q);
  const __m256i neg_bias = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.neg_bias));
#ifdef LOCALMOE_VNNI
  __m256i a = _mm256_dpbusd_epi32(neg_bias, w.w[0], _mm256_load_si256(q));
  __m256i b = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.w[4], _mm256_load_si256(q + 4));
  for (int m = 1; m < 4; ++m) {
    a = _mm256_dpbusd_epi32(a, w.w[m], _mm256_load_si256(q + m));
    b = _mm256_dpbusd_epi32(b, w.w[4 + m], _mm256_load_si256(q + 4 + m));
  }
  return _mm256_add_epi32(a, b);
#else
  // u8 x s8 pairs: |one vpmaddubsw lane| <= 2 * 24 * 127, four summed < 2^15 (no saturation)
  __m256i h[2];
  for (int k = 0; k < 2; ++k)
    h[k] = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w.w[4 * k], _mm256_load_si256(q + 4 * k)),
                                             _mm256_maddubs_epi16(w.w[4 * k + 1], _mm256_load_si256(q + 4 * k + 1))),
                            _mm256_add_epi16(_mm256_maddubs_epi16(w.w[4 * k + 2], _mm256_load_si256(q + 4 * k + 2)),
                                             _mm256_maddubs_epi16(w.w[4 * k + 3], _mm256_load_si256(q + 4 * k + 3))));
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(h[0], ones), _mm256_madd_epi16(h[1], ones)), neg_bias);
#endif
}

__attribute__((always_inline)) inline __m256 group_fma(const GroupW& w, const GroupQ8& x, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_int(w, x)), _mm256_mul_ps(w.scale, _mm256_load_ps(x.scale)), acc);
}

// Two rows' last groups of n <= 4 blocks share one group (K3 `small`'s 384-wide expert rows: 12 blocks, one group
// and a half). Row a's blocks sit in blocks 0..n-1 of the decoded group, row b's in 4..4+n-1; the token's record of
// that group with its blocks 0..3 repeated in 4..7 (tail_pair_record) gives each lane the integer sum it has
// alone: row a's in the lanes of blocks 0..3, row b's in those of 4..7, moved down to blocks 0..3's lanes
// (lanes 2, 3, 6, 7 -> 0, 1, 4, 5) for b's fp32 step. Each row's fp32 step is group_fma's, with its own scales:
// the other row's lanes meet a scale of 0 (tail_scales' dead lanes, times the record's 0 past the row) and add
// +-0 to an accumulator that is never -0 (it starts at +0), as the lanes of blocks past the row did: the same bits
// as each row alone, at half the group decodes and integer dots of the two tails.
__attribute__((always_inline)) inline GroupW rows2_last_group(const uint8_t* pa, const uint8_t* pb, int64_t g,
                                                              int64_t n) {
  const uint8_t* c[2] = {pa + g * 128, pb + g * 128};
  __m256i p[4];
  for (int k = 0; k < 4; ++k) {
    const int64_t blocks = n - 2 * (k % 2);
    const uint8_t* at = c[k / 2] + 32 * (k % 2);
    p[k] = blocks >= 2   ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
           : blocks == 1 ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))
                         : _mm256_setzero_si256();
  }
  return decode_group(p, _mm256_setzero_ps());
}

// A token's record of a last group of n <= 4 blocks with its blocks 0..3 repeated in 4..7 (lanes 0, 1, 4, 5
// copied to 2, 3, 6, 7); only its integer parts are read.
inline GroupQ8 tail_pair_record(const GroupQ8& x) {
  GroupQ8 d;
  for (int m = 0; m < 8; ++m)
    _mm256_store_si256(reinterpret_cast<__m256i*>(d.q[m]),
                       _mm256_shuffle_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(x.q[m])), 0x44));
  _mm256_store_si256(reinterpret_cast<__m256i*>(d.neg_bias),
                     _mm256_shuffle_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(x.neg_bias)), 0x44));
  _mm256_store_ps(d.scale, _mm256_setzero_ps());
  return d;
}

// The scales of a row's last group of n blocks (after g whole groups), as row_last_group takes them.
__attribute__((always_inline)) inline __m256 last_scales(const uint8_t* srow, int64_t g, int64_t n) {
  return g > 0 ? tail_scales(srow, g, n) : group_scales_table(srow + 8 * g, n);
}

// One token's fp32 steps of a shared tail (rows2_last_group: w; its scales sa, sb) into rows a and b.
__attribute__((always_inline)) inline void pair_fma(const GroupW& w, const GroupQ8& pair, const GroupQ8& x, __m256 sa,
                                                    __m256 sb, __m256& acc_a, __m256& acc_b) {
  const __m256 s = _mm256_cvtepi32_ps(group_int(w, pair));
  const __m256 xs = _mm256_load_ps(x.scale);
  acc_a = _mm256_fmadd_ps(s, _mm256_mul_ps(sa, xs), acc_a);
  acc_b = _mm256_fmadd_ps(_mm256_shuffle_ps(s, s, 0xEE), _mm256_mul_ps(sb, xs), acc_b);
}

// R consecutive weight rows (codes nb * 16 bytes apart, scales nb apart) against NT tokens' records
// (stride: records per token): each group decoded once per row, each token's record loaded once for
// the R rows, then per (row, token) the same operations as alone. Writes y[r + t * O].
// pairs: the tokens' tail_pair_record of the last group (one per token) where R is even and that group has
// 1..4 blocks (its rows then share their tails), else nullptr.
template <int R, int NT>
inline void rows_q8(const uint8_t* prow, const uint8_t* srow, int64_t nb, const GroupQ8* xq, int64_t stride,
                    const GroupQ8* pairs, float* y, int64_t O) {
  const int64_t pitch = nb * (kBlock / 2);
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; 8 * g + 8 <= nb; ++g) {
    GroupW w[R];
    for (int r = 0; r < R; ++r) w[r] = row_group(prow + r * pitch, srow + r * nb, g);
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) acc[r][t] = group_fma(w[r], xq[t * stride + g], acc[r][t]);
  }
  bool shared = false;
  if constexpr (R % 2 == 0) {
    if (pairs != nullptr) {
      const int64_t n = nb - 8 * g;
      for (int r = 0; r < R; r += 2) {
        const GroupW w = rows2_last_group(prow + r * pitch, prow + (r + 1) * pitch, g, n);
        const __m256 sa = last_scales(srow + r * nb, g, n), sb = last_scales(srow + (r + 1) * nb, g, n);
        for (int t = 0; t < NT; ++t) pair_fma(w, pairs[t], xq[t * stride + g], sa, sb, acc[r][t], acc[r + 1][t]);
      }
      shared = true;
    }
  }
  if (!shared && 8 * g < nb) {
    GroupW w[R];
    for (int r = 0; r < R; ++r) w[r] = row_last_group(prow + r * pitch, srow + r * nb, g, nb - 8 * g);
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) acc[r][t] = group_fma(w[r], xq[t * stride + g], acc[r][t]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) y[r + t * O] = hsum(acc[r][t]);
}

// hsum of a, b, c, d into y[0..3], by the same operations as hsum on each (the same bits): the two halves,
// then the two pairs, then the last two of each vector, four vectors at a time.
__attribute__((always_inline)) inline void hsum4(__m256 a, __m256 b, __m256 c, __m256 d, float* y) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  const __m256d ab2 = _mm256_castps_pd(ab), cd2 = _mm256_castps_pd(cd);
  const __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab2, cd2)),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(ab2, cd2)));  // a0+a2 a1+a3 c.. c.. | b.. d..
  const __m256 r = _mm256_add_ps(t, _mm256_movehdup_ps(t));                      // a at 0, c at 2, b at 4, d at 6
  _mm_storeu_ps(y, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 2, 6, 0, 4, 2, 6))));
}

// Four consecutive rows against one token: each row's sums and fp32 steps as rows_q8<1, 1> (the same bits),
// the four in flight together and summed up by one hsum4; pair: as rows_q8's pairs (rows 0, 1 and 2, 3 share
// their tails). Writes y[0..3].
inline void rows4_q8_one(const uint8_t* prow, const uint8_t* srow, int64_t nb, const GroupQ8* xq,
                         const GroupQ8* pair, float* y) {
  const int64_t pitch = nb * (kBlock / 2);
  __m256 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; 8 * g + 8 <= nb; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[r] = group_fma(row_group(prow + r * pitch, srow + r * nb, g), xq[g], acc[r]);
  if (pair != nullptr) {
    const int64_t n = nb - 8 * g;
#pragma GCC unroll 2
    for (int r = 0; r < 4; r += 2)
      pair_fma(rows2_last_group(prow + r * pitch, prow + (r + 1) * pitch, g, n), *pair, xq[g],
               last_scales(srow + r * nb, g, n), last_scales(srow + (r + 1) * nb, g, n), acc[r], acc[r + 1]);
  } else if (8 * g < nb) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
      acc[r] = group_fma(row_last_group(prow + r * pitch, srow + r * nb, g, nb - 8 * g), xq[g], acc[r]);
  }
  hsum4(acc[0], acc[1], acc[2], acc[3], y);
}

// The most tokens rows_q8 takes in one pass over the rows (AVX-512's 32 vector registers: 2 rows'
// decoded groups and accumulators; AVX2's 16: one row's).
#ifdef LOCALMOE_VNNI
constexpr int kQ8Rows = 2, kQ8Tokens = 6;
#else
constexpr int kQ8Rows = 1, kQ8Tokens = 4;
#endif

// rows_q8<R, n> for 1 <= n <= kQ8Tokens.
template <int R, int NT = kQ8Tokens>
inline void rows_q8_n(int n, const uint8_t* prow, const uint8_t* srow, int64_t nb, const GroupQ8* xq, int64_t stride,
                      const GroupQ8* pairs, float* y, int64_t O) {
  if constexpr (NT > 1) {
    if (n < NT) return rows_q8_n<R, NT - 1>(n, prow, srow, nb, xq, stride, pairs, y, O);
  }
  rows_q8<R, NT>(prow, srow, nb, xq, stride, pairs, y, O);
}

// R rows against N tokens in the fewest passes of at most kQ8Tokens, their sizes as even as can be (each
// pass decodes the rows again; a token's cost falls with the pass's size: 12 tokens as 6 + 6 took 0.93x
// the CPU of 4 + 4 + 4, Zen 4). A (row, token)'s operations do not depend on the pass: the same bits.
template <int R>
inline void rows_q8_tokens(const uint8_t* prow, const uint8_t* srow, int64_t nb, const GroupQ8* xq, int64_t stride,
                           const GroupQ8* pairs, int64_t N, float* y, int64_t O) {
  for (int64_t t = 0, passes = (N + kQ8Tokens - 1) / kQ8Tokens; t < N; --passes) {
    const int64_t n = (N - t + passes - 1) / passes;
    rows_q8_n<R>(static_cast<int>(n), prow, srow, nb, xq + t * stride, stride, pairs == nullptr ? nullptr : pairs + t,
                 y + t * O, O);
    t += n;
  }
}

// Rows [o0, o1) of a matrix (packed [O, K/2], scales [O, K/32]) against N tokens' q8 records (stride
// q8_groups(K / 32) per token): y[o + t * O]. One token: a row at a time (interleaved rows' streams
// defeat the prefetchers when the weights come from memory).
inline void matrix_q8(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t o0, int64_t o1,
                      const GroupQ8* xq, int64_t N, float* y, int64_t O) {
  const int64_t nb = K / kBlock, stride = q8_groups(nb), tail = nb % 8;
  // each token's tail_pair_record where the rows' last group has 1..4 blocks (rows then go in pairs)
  constexpr int64_t kLocal = 8;
  GroupQ8 local[kLocal];
  std::unique_ptr<GroupQ8[]> heap;
  const GroupQ8* pairs = nullptr;
  if (tail != 0 && tail <= 4) {
    GroupQ8* p = N <= kLocal ? local : (heap.reset(new GroupQ8[N]), heap.get());
    for (int64_t t = 0; t < N; ++t) p[t] = tail_pair_record(xq[t * stride + nb / 8]);
    pairs = p;
  }
  int64_t o = o0;
  if (N == 1) {
    for (; o + 4 <= o1; o += 4) rows4_q8_one(packed + o * (K / 2), scales + o * nb, nb, xq, pairs, y + o);
    for (; o < o1; ++o) rows_q8<1, 1>(packed + o * (K / 2), scales + o * nb, nb, xq, stride, nullptr, y + o, O);
    return;
  }
  for (; o + kQ8Rows <= o1; o += kQ8Rows)
    rows_q8_tokens<kQ8Rows>(packed + o * (K / 2), scales + o * nb, nb, xq, stride, pairs, N, y + o, O);
  for (; o < o1; ++o) rows_q8_tokens<1>(packed + o * (K / 2), scales + o * nb, nb, xq, stride, nullptr, N, y + o, O);
}

}  // namespace localmoe_mxfp4
