// IQ4_NL and IQ4_XS rows straight from their blocks (included by ggml_rows.h after rows8; dispatch there and in
// ggml_moe_cpu.cpp `row_fn`).
//
// IQ4_NL: blocks of 32 values, 18 bytes: fp16 d, 16 bytes of nibbles (Q4_0's layout: value j in the low nibble of
// byte j, j + 16 in the high one); value = d * kvalues[nibble], kvalues the 16 non-uniform int8 levels below.
// IQ4_XS: super-blocks of 256 values, 136 bytes: fp16 d, 16-bit scales_h, 4 bytes scales_l, 128 bytes of nibbles;
// sub-block j (32 values, bytes 8 + 16j ..) is an IQ4_NL block with the step d * (ls_j - 32), ls_j 6 bits: the
// nibble j of scales_l (bit 4j of its 32-bit word) below the bits 2j, 2j + 1 of scales_h.
//
// Both read x rounded to int8 per 32 values (BlockX, as Q4_0 / Q8_0; IQ4_XS too: one step per 32 on either side, so
// a block's product is step_w * d_x with no integer scale products). The nibbles become the signed int8 levels by
// one vpshufb into the table; from there a block is a Q8_0 block (codes -127..113): rows eight at a time through
// rows8's Block8 / dot8<kQ8_0> (VNNI: x + 128 as u8 against the signed codes, minus 128 sum(codes); AVX2: |codes|
// against x with the codes' signs, |pair| <= 2 * 127 * 127), sixteen at a time on AVX-512 for 2+ tokens, a lone row
// the same integer sum in another order. Per (row, token), over the blocks in order:
//   acc = fma(float(sum_j code_w q_x), step_w * d_x, acc)
// (the step an exact fp32: an fp16 times a 6-bit integer), then + bias: the same chain in a group of eight or
// sixteen or alone, whatever the tokens beside it, on both ISAs (the integer sums are exact).
#pragma once

namespace localmoe_ggml {

// kvalues_iq4nl in both 128-bit lanes (a vpshufb table).
inline __m256i iq4_levels() {
  return _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                          -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

// Block b (of 32) of a row: its 16 nibble bytes.
template <int T>
inline const uint8_t* iq4_nibbles(const uint8_t* row, int64_t b) {
  return T == kIQ4_NL ? row + 18 * b + 2 : row + 136 * (b / 8) + 8 + 16 * (b % 8);
}

// Block b's step as an fp32 (exact).
template <int T>
inline float iq4_step(const uint8_t* row, int64_t b) {
  if (T == kIQ4_NL) return half(row + 18 * b);
  const uint8_t* sb = row + 136 * (b / 8);
  const int j = static_cast<int>(b % 8);
  uint16_t h;
  uint32_t l;
  std::memcpy(&h, sb + 2, 2);
  std::memcpy(&l, sb + 4, 4);
  const int ls = static_cast<int>(((l >> (4 * j)) & 0xF) | (((h >> (2 * j)) & 3) << 4));
  return half(sb) * static_cast<float>(ls - 32);
}

// Eight rows' block b (rows `stride` apart from row0) as rows8's Block8 of signed codes (Q8_0's form).
template <int T>
__attribute__((always_inline)) inline void iq4_load8(const uint8_t* row0, int64_t stride, int64_t b, Block8& o) {
  if (T == kIQ4_NL) {
    o.d = halves8(gather8(row0 + 18 * b, stride), false);
  } else {
    const uint8_t* sb = row0 + 136 * (b / 8);
    const int j = static_cast<int>(b % 8);
    const __m256i head = gather8(sb, stride);  // fp16 d | scales_h << 16
    const __m256i low = _mm256_and_si256(_mm256_srl_epi32(gather8(sb + 4, stride), _mm_cvtsi32_si128(4 * j)),
                                         _mm256_set1_epi32(0xF));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi32(head, _mm_cvtsi32_si128(16 + 2 * j)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
    o.d = _mm256_mul_ps(halves8(head, false), _mm256_cvtepi32_ps(ls));
  }
  const uint8_t* nib = iq4_nibbles<T>(row0, b);
  __m256i rows[4], dw[4];
  for (int r = 0; r < 4; ++r)
    rows[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(nib + (r + 4) * stride),
                                  reinterpret_cast<const __m128i*>(nib + r * stride));
  transpose4(rows, dw);
  const __m256i low4 = _mm256_set1_epi8(0x0F), levels = iq4_levels();
  for (int k = 0; k < 4; ++k) {
    o.codes[k] = _mm256_shuffle_epi8(levels, _mm256_and_si256(dw[k], low4));                              // 4k..
    o.codes[k + 4] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(dw[k], 4), low4));  // 16+4k..
  }
  if (kVnni) {
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) s = _mm256_dpbusd_epi32(s, _mm256_set1_epi8(static_cast<char>(0x80)), o.codes[i]);
    o.bias8 = _mm256_sub_epi32(_mm256_setzero_si256(), s);
  }
}

// Rows r .. r + 7 against TN tokens: y[t * ldy + r ..] = the eight values (+ bias).
template <int T, int TN>
inline void iq4_group8(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX* const* x, float* y, int64_t ldy,
                       const float* bias) {
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  const NextGroup ahead(row0, 8, stride, nb);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    Block8 w;
    iq4_load8<T>(row0, stride, b, w);
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const BlockX& xb = x[t][b];
      const __m256 dot = _mm256_cvtepi32_ps(dot8<kQ8_0, (TN < 4 ? 4 / TN : 1)>(w, xb.q));
      acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(w.d, _mm256_broadcast_ss(&xb.d)), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Rows r .. r + 15 against TN tokens (group16's form: lanes 0-7 rows r.., 8-15 rows r + 8..; per lane group8's
// operations in group8's order).
template <int T, int TN>
inline void iq4_group16(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX* const* x, float* y,
                        int64_t ldy, const float* bias) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(row0, 16, stride, nb);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    Block8 lo, hi;
    iq4_load8<T>(row0, stride, b, lo);
    iq4_load8<T>(row0 + 8 * stride, stride, b, hi);
    __m512i codes[8];
    for (int i = 0; i < 8; ++i) codes[i] = join8(lo.codes[i], hi.codes[i]);
    const __m512 d = join8(lo.d, hi.d);
    const __m512i bias8 = join8(lo.bias8, hi.bias8);
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const BlockX& xb = x[t][b];
      __m512i s[2] = {bias8, _mm512_setzero_si512()};
      for (int i = 0; i < 8; ++i)
        s[i % 2] = _mm512_dpbusd_epi32(s[i % 2], _mm512_xor_si512(_mm512_set1_epi32(load_u32(xb.q + 4 * i)), flip),
                                       codes[i]);
      s[0] = _mm512_add_epi32(s[0], s[1]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}
#endif

// One row against one token: the value iq4_group8 gives that (row, token), computed alone.
template <int T>
inline float iq4_single(const uint8_t* row, int64_t nb, const BlockX* x) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i levels = iq4_levels();
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockX& xb = x[b];
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq4_nibbles<T>(row, b)));
    const __m256i w = _mm256_shuffle_epi8(levels, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4),
                                                                   _mm_and_si128(q, low4)));
    const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q)), w);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), dot_u8s8(_mm256_sign_epi8(w, w), xq));  // no level is 0
    int32_t dot = 0;
    for (int i = 0; i < 8; ++i) dot += lanes[i];
    acc = std::fma(static_cast<float>(dot), iq4_step<T>(row, b) * xb.d, acc);
  }
  return acc;
}

// IQ4_NL / IQ4_XS rows as a group kernel for rows_fixed (Rows8's shape: sixteen rows at a time first for 2+ tokens
// on AVX-512 VNNI).
template <int T>
struct RowsIQ4 {
  using X = BlockX;
  static constexpr int kTile = kTile8;
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nb, const BlockX* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    int64_t r = r0;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (TN > 1)
      for (; r + 16 <= r1; r += 16)
        iq4_group16<T, TN>(w + r * stride, stride, nb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
#endif
    return r;
  }
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nb,
                                                   const BlockX* const* x, float* y, int64_t ldy, const float* bias) {
    iq4_group8<T, TN>(row0, stride, nb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nb, const BlockX* x) { return iq4_single<T>(row, nb, x); }
};

template <class U>
constexpr bool kIq4Rows = false;
template <int T>
constexpr bool kIq4Rows<RowsIQ4<T>> = true;

}  // namespace localmoe_ggml
