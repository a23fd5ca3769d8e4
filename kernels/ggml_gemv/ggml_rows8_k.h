// Q4_K and Q5_K rows eight at a time ("rows8k"), against x rounded per 256 (BlockXK); included by ggml_rows.h after rows8,
// whose halves8 / transpose4 / codes4 it uses. Q5_K is Q4_K with 32 bytes of fifth bits (qh) between the scales and
// the nibbles: bit j of qh[i] is value i of sub-block j's fifth bit, added as 16 to the nibble (`fifth_bit`); all
// below holds for both (kFifth: Q5_K). Q5_K ran one row at a time (Q45KInt8<true>) before session 8; the form of
// 8-lane fp32 chains it took there changed into this one chain, so its int8 bits changed (as Q4_K's did in session 6).
//
// A super-block of eight consecutive rows is decoded once into vectors with one lane per row: d and dmin, the eight
// 6-bit scales and mins (the rows' first 16 bytes transposed, halves8, then llama.cpp's masks on 32-bit lanes: lane r
// of `scale j` is row r's sc[j]), and per pair of sub-blocks the 32 nibble bytes of the
// eight rows transposed (lane r of dw[i]: row r's bytes 4i..4i+3; the low nibbles are sub-block 2p, the high ones
// 2p + 1). Every token of a tile then takes, per sub-block, eight vpdpbusd of those codes against its x codes
// broadcast four at a time (AVX2: vpmaddubsw + vpmaddwd, |pair| <= 2 * 31 * 128), so lane r ends with row r's exact
// integer dot product of the sub-block, multiplied by the scale (vpmulld) into the super-block's integer sum
// (|sum| <= 8 * 63 * 32 * 31 * 128 < 2^31). The mins come in as sum_j m[j] sum(x_j), integers below 2^24, exact in
// fp32 in any order. Per (row, token) the value is then, over the super-blocks in order,
//   acc = fma(float(sum), d_w * d_x, acc);  acc = fma(-mins, dmin_w * d_x, acc)
// one fp32 chain whatever the rows or tokens beside it and on both ISAs. The per-row form (Q45KInt8, removed in session 8)
// spent a vpmaddubsw, vpmaddwd, add and scale shuffle per row, token and sub-block where a tile spends one vpdpbusd;
// the transposition is paid once per eight rows (1024 x 512 at 16 tokens: 1.6-1.8x). One token takes the per-row
// products and sums them across lanes (group8_qk_one: same bits, ~1.0-1.2x the per-row form); a range's leftover rows
// take qk_row (same bits).
#pragma once

namespace localmoe_ggml {

// Tokens per tile of rows8k: an accumulator and an integer sum per token beside the eight code vectors.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kTileK8 = 8;
#else
constexpr int kTileK8 = 4;
#endif

// acc + the u8 x s8 products of u and s summed four at a time per int32 lane (exact: every caller's pairs < 2^15).
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A K-quant super-block's layout: bytes, and where the nibbles start (Q4_K: after d, dmin and the 12 scale bytes;
// Q5_K: after the 32 bytes of fifth bits too).
template <bool kFifth>
struct KLayout {
  static constexpr int64_t kBytes = kFifth ? 176 : 144, kNibbles = kFifth ? 48 : 16;
};

// codes | 16 where bit j of the byte of qh is set (per byte: the mask keeps bit j, a shift within the byte moves it to
// bit 4; a 16-bit shift by at most 4 cannot carry a masked bit into the next byte).
__attribute__((always_inline)) inline __m256i fifth_bit(__m256i codes, __m256i qh, int j) {
  const __m256i bit = _mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(1 << j)));
  const __m256i at4 = j < 4 ? _mm256_slli_epi16(bit, 4 - j) : j > 4 ? _mm256_srli_epi16(bit, j - 4) : bit;
  return _mm256_or_si256(codes, at4);
}

// dw[i] lane r: bytes 4i..4i+3 of the 32 at p + r * stride (r < 8).
__attribute__((always_inline)) inline void transpose8x32(const uint8_t* p, int64_t stride, __m256i dw[8]) {
  __m256i lo[4], hi[4];
  for (int r = 0; r < 4; ++r) {
    const uint8_t* a = p + r * stride;
    const uint8_t* b = p + (r + 4) * stride;
    lo[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b), reinterpret_cast<const __m128i*>(a));
    hi[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + 16), reinterpret_cast<const __m128i*>(a + 16));
  }
  transpose4(lo, dw);
  transpose4(hi, dw + 4);
}

// The first 16 bytes of a super-block in eight rows (fp16 d, dmin; the 12 scale bytes), transposed: lane r of head[k]
// is dword k of row r (eight scalar stores read back as a vector would not forward: gather8 is for one dword per block).
__attribute__((always_inline)) inline void heads8(const uint8_t* blk, int64_t stride, __m256i head[4]) {
  __m256i rows[4];
  for (int r = 0; r < 4; ++r)
    rows[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk + (r + 4) * stride),
                                  reinterpret_cast<const __m128i*>(blk + r * stride));
  transpose4(rows, head);
}

// Q4_K_R8 (kQ4_K_R8): Q4_K rows repacked at load (ggml_repack, ggml_cpu.cpp) into what heads8 and transpose8x32 make of
// them at run time, so that the row kernels load it as it is. Eight rows' super-block u (the rows' 8 x 144 bytes, at
// the same place as the rows' bytes in the GGUF layout: group g of rows 8g .. 8g + 7, super-block u at 8g * stride +
// 1152 u) is 128 bytes of heads (dword k of row r at 32 k + 4 r: fp16 d | dmin, then the 12 bytes of 6-bit scales and
// mins) and 1024 bytes of nibbles (pair of sub-blocks p, column i: row r's nibble bytes 32 p + 4 i .. + 3 at
// 128 + 32 (8 p + i) + 4 r). Same bytes, same values, same chains: the bits of the GGUF layout's rows on every path;
// a matrix of a multiple of eight rows only (the loader keeps others as they are).
constexpr int64_t kR8Bytes = 8 * 144;

// The eight rows' 6-bit scales (sc) and mins (mn) of a super-block, one byte per sub-block, from the three 32-byte
// words after d / dmin (head[1..3]: as heads8 / r8_heads give them).
__attribute__((always_inline)) inline void k4_scales_mins(const __m256i head[4], __m256i sc[2], __m256i mn[2]) {
  const __m256i w0 = head[1], w1 = head[2], w2 = head[3];
  const __m256i six = _mm256_set1_epi32(0x3F3F3F3F), four = _mm256_set1_epi32(0x0F0F0F0F);
  const __m256i two = _mm256_set1_epi32(0x03030303);
  sc[0] = _mm256_and_si256(w0, six);
  sc[1] = _mm256_or_si256(_mm256_and_si256(w2, four),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), two), 4));
  mn[0] = _mm256_and_si256(w1, six);
  mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), four),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), two), 4));
}

__attribute__((always_inline)) inline void r8_heads(const uint8_t* blk, __m256i head[4]) {
  for (int k = 0; k < 4; ++k) head[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * k));
}

__attribute__((always_inline)) inline void r8_codes(const uint8_t* blk, int p, __m256i dw[8]) {
  for (int i = 0; i < 8; ++i) dw[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * (8 * p + i)));
}

// Q4_K rows [O, nsb * 144] (O a multiple of 8) into Q4_K_R8 (`pack`) or back; src may be dst (one group at a time
// through `tmp`, 8 * nsb * 144 bytes).
inline void repack_q4k(const uint8_t* src, uint8_t* dst, int64_t O, int64_t nsb, bool pack, uint8_t* tmp) {
  const int64_t group = 8 * nsb * 144;
  for (int64_t g = 0; g < O / 8; ++g) {
    std::memcpy(tmp, src + g * group, group);
    uint8_t* out = dst + g * group;
    for (int r = 0; r < 8; ++r)
      for (int64_t u = 0; u < nsb; ++u) {
        uint8_t* plain = (pack ? tmp : out) + r * nsb * 144 + u * 144;
        uint8_t* packed = (pack ? out : tmp) + u * kR8Bytes;
        const auto move = [&](int64_t at_plain, int64_t at_packed) {
          if (pack) std::memcpy(packed + at_packed, plain + at_plain, 4);
          else std::memcpy(plain + at_plain, packed + at_packed, 4);
        };
        for (int k = 0; k < 4; ++k) move(4 * k, 32 * k + 4 * r);
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 8; ++i) move(16 + 32 * p + 4 * i, 128 + 32 * (8 * p + i) + 4 * r);
      }
  }
}

// Rows r .. r + 7 (Q4_K / Q5_K, rows of `stride` bytes, nsb super-blocks) against TN tokens (x[t]: token t's
// super-blocks): y[t * ldy + r ..] = the eight values (+ bias). Q5_K's fifth bits are transposed as the nibbles are.
// kR8: Q4_K_R8 (below): the first 16 bytes and the nibbles come transposed already.
template <int TN, bool kFifth, bool kR8 = false>
inline void group8_qk(const uint8_t* row0, int64_t stride, int64_t nsb, const BlockXK* const* x, float* y,
                      int64_t ldy, const float* bias) {
  using L = KLayout<kFifth>;
  static_assert(!(kR8 && kFifth), "Q4_K_R8 only");
  constexpr int kChains = TN == 1 ? 2 : 1;  // a lone token's eight dependent vpdpbusd per sub-block, split
  const __m256i low4 = _mm256_set1_epi8(0x0F), byte = _mm256_set1_epi32(0xFF);
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  const uint8_t* next = row0 + 8 * stride;  // the next group's eight rows, fetched while this one runs
  const int64_t per_block = (8 * stride + 64 * nsb - 1) / (64 * nsb);
  for (int64_t u = 0; u < nsb; ++u) {
    for (int64_t l = 0; l < per_block; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * (u * per_block + l)), _MM_HINT_T0);
    const uint8_t* blk = row0 + u * (kR8 ? 8 * L::kBytes : L::kBytes);
    __m256i head16[4], dh[8];
    if constexpr (kR8) r8_heads(blk, head16);
    else heads8(blk, stride, head16);
    if constexpr (kFifth) transpose8x32(blk + 16, stride, dh);
    const __m256 d = halves8(head16[0], false), dmin = halves8(head16[0], true);
    __m256i sc[2], mn[2];
    k4_scales_mins(head16, sc, mn);
    __m256i sum[TN];
    __m256 mins[TN];
    for (int t = 0; t < TN; ++t) sum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // sum_j m[j] sum(x_j): integers below 2^24, exact
      const __m256 m = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), byte));
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t)
        mins[t] = j == 0 ? _mm256_mul_ps(m, _mm256_broadcast_ss(&x[t][u].sums[0]))
                         : _mm256_fmadd_ps(m, _mm256_broadcast_ss(&x[t][u].sums[j]), mins[t]);
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      __m256i dw[8];
      if constexpr (kR8) r8_codes(blk, p, dw);
      else transpose8x32(blk + L::kNibbles + 32 * p, stride, dw);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        __m256i codes[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          codes[i] = _mm256_and_si256(h ? _mm256_srli_epi16(dw[i], 4) : dw[i], low4);
          if constexpr (kFifth) codes[i] = fifth_bit(codes[i], dh[i], j);
        }
        const __m256i scale = _mm256_and_si256(_mm256_srli_epi32(sc[j / 4], 8 * (j % 4)), byte);
#pragma GCC unroll 8
        for (int t = 0; t < TN; ++t) {
          const int8_t* q = x[t][u].q + 32 * j;
          __m256i s[kChains];
          for (int c = 0; c < kChains; ++c) s[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) s[i % kChains] = dot4_add(s[i % kChains], codes[i], codes4(q, i));
          for (int c = 1; c < kChains; ++c) s[0] = _mm256_add_epi32(s[0], s[c]);
          sum[t] = _mm256_add_epi32(sum[t], _mm256_mullo_epi32(s[0], scale));
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TN; ++t) {
      const __m256 xd = _mm256_broadcast_ss(&x[t][u].d);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, xd), acc[t]);
      acc[t] = _mm256_fnmadd_ps(mins[t], _mm256_mul_ps(dmin, xd), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

// Row r's super-block `blk` against x's: the per-row form's 8 int32 lanes (the scales shuffled out of a register,
// vpmaddubsw + madd_add), whose sum is the super-block's integer sum; two chains of sums (exact in any order: a single
// vpdpwssd chain waited on its latency; with two, 1.05-1.1x from cache, Zen 4).
template <bool kFifth>
__attribute__((always_inline)) inline __m256i qk_lanes(const uint8_t* blk, const BlockXK& xb) {
  using L = KLayout<kFifth>;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i qh = kFifth ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : low4;
  uint64_t sc8, mn8;
  q4_k_scales(blk + 4, sc8, mn8);
  const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc8)));
  const __m256i scales = _mm256_set_m128i(sc16, sc16);
  __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kNibbles + 32 * p));
    __m256i w[2] = {_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * p + h;
      if constexpr (kFifth) w[h] = fifth_bit(w[h], qh, j);
      const char a = static_cast<char>(2 * j), c = static_cast<char>(2 * j + 1);
      const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_setr_epi8(a, c, a, c, a, c, a, c, a, c, a, c, a, c, a, c,
                                                                         a, c, a, c, a, c, a, c, a, c, a, c, a, c, a, c));
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q + 32 * j));
      sum[h] = madd_add(sum[h], _mm256_maddubs_epi16(w[h], xq), scale);
    }
  }
  return _mm256_add_epi32(sum[0], sum[1]);
}

// One row against one token, the same chain as group8_qk's lane for that (row, token): the per-row form (a
// super-block's sub-blocks in the 8 int32 lanes, each scale shuffled out of a register) for a lone token, where
// eight rows' transposition costs more than it saves (one token, Zen 4: 0.64-0.9x), and for a range's leftover rows.
// The integer sums and sum_j m[j] sum(x_j) (in int32 here: exact, the same value) of up to four super-blocks are
// summed across lanes together (three vphaddd each), converted, then the scalar FMAs in super-block order
// (qk_supers: N <= 4 super-blocks, unrolled).
template <int N, bool kFifth>
__attribute__((always_inline)) inline float qk_supers(const uint8_t* row, const BlockXK* x, float acc) {
  __m256i sum[4], mins[4];
  float step[N], offset[N];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    sum[k] = mins[k] = _mm256_setzero_si256();
    if (k >= N) continue;
    const uint8_t* blk = row + k * KLayout<kFifth>::kBytes;
    const BlockXK& xb = x[k];
    sum[k] = qk_lanes<kFifth>(blk, xb);
    uint64_t sc8, mn8;
    q4_k_scales(blk + 4, sc8, mn8);
    mins[k] = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn8))),
                                 _mm256_cvttps_epi32(_mm256_loadu_ps(xb.sums)));
    step[k] = half(blk) * xb.d;
    offset[k] = half(blk + 2) * xb.d;
  }
  // [S0 S1 S2 S3]: hadd(hadd(S0, S1), hadd(S2, S3)) holds each one's low-half and high-half sums
  const auto across = [](const __m256i* v) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  };
  const __m128 fs = across(sum), fm = across(mins);
  alignas(16) float s[4], m[4];
  _mm_store_ps(s, fs);
  _mm_store_ps(m, fm);
#pragma GCC unroll 4
  for (int k = 0; k < N; ++k) {
    acc = std::fma(s[k], step[k], acc);
    acc = std::fma(-m[k], offset[k], acc);
  }
  return acc;
}

template <bool kFifth>
inline float qk_row(const uint8_t* row, int64_t nsb, const BlockXK* x) {
  constexpr int64_t B = KLayout<kFifth>::kBytes;
  float acc = 0.0f;
  int64_t u = 0;
  for (; u + 4 <= nsb; u += 4) acc = qk_supers<4, kFifth>(row + u * B, x + u, acc);
  switch (nsb - u) {
    case 3: return qk_supers<3, kFifth>(row + u * B, x + u, acc);
    case 2: return qk_supers<2, kFifth>(row + u * B, x + u, acc);
    case 1: return qk_supers<1, kFifth>(row + u * B, x + u, acc);
    default: return acc;
  }
}

// Rows r .. r + 7 against ONE token, the bits of group8_qk<1> at less work: each row's super-blocks go through the
// per-row form (qk_lanes), row after row (the weights read in order: eight rows a super-block at a time ran at
// ~0.5x from memory), up to kRunK super-blocks at a time; then per super-block the eight rows' lane vectors are summed
// across lanes into one vector with a lane per row (seven vphaddd), and d, dmin and the mins come from the transposed
// first 16 bytes as in group8_qk. (Transposing the codes costs more than it saves for one token: 0.64-0.9x, Zen 4.)
constexpr int64_t kRunK = 16;

template <bool kFifth>
inline void group8_qk_one(const uint8_t* row0, int64_t stride, int64_t nsb, const BlockXK* x, float* y,
                          const float* bias) {
  constexpr int64_t B = KLayout<kFifth>::kBytes;
  const __m256i byte = _mm256_set1_epi32(0xFF);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t u0 = 0; u0 < nsb; u0 += kRunK) {
    const int64_t n = std::min(kRunK, nsb - u0);
    __m256i lanes[kRunK][8];
    for (int r = 0; r < 8; ++r) {
      prefetch_ahead(row0 + (kAheadRows + r) * stride + u0 * B, n * B);
      for (int64_t k = 0; k < n; ++k) lanes[k][r] = qk_lanes<kFifth>(row0 + r * stride + (u0 + k) * B, x[u0 + k]);
    }
    for (int64_t k = 0; k < n; ++k) {
      const uint8_t* blk = row0 + (u0 + k) * B;
      const BlockXK& xb = x[u0 + k];
      __m256i head16[4];
      heads8(blk, stride, head16);
      const __m256 d = halves8(head16[0], false), dmin = halves8(head16[0], true);
      __m256i sc[2], mn[2];  // (the scales come from the lanes: sc is left unused, dropped by the compiler)
      k4_scales_mins(head16, sc, mn);
      __m256 mins = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 m = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), byte));
        mins = j == 0 ? _mm256_mul_ps(m, _mm256_broadcast_ss(&xb.sums[0]))
                      : _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xb.sums[j]), mins);
      }
      // hadd(hadd(S0, S1), hadd(S2, S3)) = [S0 S1 S2 S3 low halves | high halves], likewise S4..S7
      const __m256i* s = lanes[k];
      const __m256i h03 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
      const __m256i h47 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
      const __m256i total = _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),
                                             _mm256_permute2x128_si256(h03, h47, 0x31));
      const __m256 xd = _mm256_broadcast_ss(&xb.d);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, xd), acc);
      acc = _mm256_fnmadd_ps(mins, _mm256_mul_ps(dmin, xd), acc);
    }
  }
  _mm256_storeu_ps(y, bias == nullptr ? acc : _mm256_add_ps(acc, _mm256_loadu_ps(bias)));
}

// rows8k as a group kernel for rows_fixed (ggml_rows.h): group8_qk_one for one token, group8_qk for a tile
// (Rows8K: Q4_K, Rows8K5: Q5_K).
template <bool kFifth>
struct Rows8QK : NoWide {
  using X = BlockXK;
  static constexpr int kTile = kTileK8;
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nsb,
                                                   const BlockXK* const* x, float* y, int64_t ldy, const float* bias) {
    if constexpr (TN == 1) group8_qk_one<kFifth>(row0, stride, nsb, x[0], y, bias);
    else group8_qk<TN, kFifth>(row0, stride, nsb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nsb, const BlockXK* x) { return qk_row<kFifth>(row, nsb, x); }
};
using Rows8K = Rows8QK<false>;
using Rows8K5 = Rows8QK<true>;

// Q4_K_R8 rows eight at a time against ONE token: group8_qk<1>'s operations on the repacked bytes (no transposition:
// one load per 4 bytes of eight rows, two mask / shift operations and two vpdpbusd per load, in two chains per
// sub-block), the bits of group8_qk_one. The bytes are read in order, one stream: no software prefetch (16 rows ahead,
// as group8_qk_one fetches, made 64 matrices of 2048 x 1024 0.83-0.85x from memory; without: 1.02-1.15x, Zen 4).
inline void group8_r8_one(const uint8_t* row0, int64_t stride, int64_t nsb, const BlockXK* x, float* y,
                          const float* bias) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), byte = _mm256_set1_epi32(0xFF);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t u = 0; u < nsb; ++u) {
    const uint8_t* blk = row0 + u * kR8Bytes;
    const BlockXK& xb = x[u];
    __m256i head16[4];
    r8_heads(blk, head16);
    const __m256 d = halves8(head16[0], false), dmin = halves8(head16[0], true);
    __m256i sc[2], mn[2];
    k4_scales_mins(head16, sc, mn);
    __m256 mins = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // sum_j m[j] sum(x_j): integers below 2^24, exact
      const __m256 m = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), byte));
      mins = j == 0 ? _mm256_mul_ps(m, _mm256_broadcast_ss(&xb.sums[0]))
                    : _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xb.sums[j]), mins);
    }
    __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      __m256i s[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                         {_mm256_setzero_si256(), _mm256_setzero_si256()}};
      const int8_t* q = xb.q + 64 * p;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * (8 * p + i)));
        s[0][i & 1] = dot4_add(s[0][i & 1], _mm256_and_si256(v, low4), codes4(q, i));
        s[1][i & 1] = dot4_add(s[1][i & 1], _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), codes4(q + 32, i));
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        const __m256i scale = _mm256_and_si256(_mm256_srli_epi32(sc[j / 4], 8 * (j % 4)), byte);
        sum = _mm256_add_epi32(sum, _mm256_mullo_epi32(_mm256_add_epi32(s[h][0], s[h][1]), scale));
      }
    }
    const __m256 xd = _mm256_broadcast_ss(&xb.d);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, xd), acc);
    acc = _mm256_fnmadd_ps(mins, _mm256_mul_ps(dmin, xd), acc);
  }
  _mm256_storeu_ps(y, bias == nullptr ? acc : _mm256_add_ps(acc, _mm256_loadu_ps(bias)));
}

// A repacked type's rows as a group kernel for rows_fixed (Rows8KR8, Rows8K6R8: G::group<TN> on eight rows): `wide`
// takes every row of the range, eight at a time; a group the range cuts (a caller's chunk of rows not on a multiple of
// eight) is computed whole into a buffer and the range's rows copied out (a repacked row cannot be read alone).
template <class G>
struct WholeGroups {
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nsb, const BlockXK* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    for (int64_t r = r0; r < r1;) {
      const int64_t g = r / 8 * 8;
      if (g == r && r + 8 <= r1) {
        G::template group<TN>(w + r * stride, stride, nsb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
        r += 8;
        continue;
      }
      float part[8 * TN];
      G::template group<TN>(w + g * stride, stride, nsb, x, part, 8, nullptr);
      for (const int64_t end = std::min(r1, g + 8); r < end; ++r)
        for (int t = 0; t < TN; ++t)
          y[t * ldy + r] = bias == nullptr ? part[8 * t + r - g] : part[8 * t + r - g] + bias[r];
    }
    return r1;
  }
  static float single(const uint8_t*, int64_t, const BlockXK*) { return std::nanf(""); }  // never: wide takes all
};

// Q4_K_R8 as a group kernel for rows_fixed.
struct Rows8KR8 : WholeGroups<Rows8KR8> {
  using X = BlockXK;
  static constexpr int kTile = kTileK8;
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nsb,
                                                   const BlockXK* const* x, float* y, int64_t ldy, const float* bias) {
    if constexpr (TN == 1) group8_r8_one(row0, stride, nsb, x[0], y, bias);
    else group8_qk<TN, false, true>(row0, stride, nsb, x, y, ldy, bias);
  }
};

}  // namespace localmoe_ggml
