// GGUF block GEMV rows (AVX2 + FMA + F16C) shared by `ggml_gemv` (ggml_cpu.cpp) and the decode
// steps that read GGUF weights (kernels/_cpu/matrix.h); what and why: ggml_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pool.h"
#include "vec_math.h"

namespace localmoe_ggml {

using localmoe::hsum;

constexpr int64_t kBlock = 32;
// GGMLQuantizationType values
enum Type : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                 kIQ4_NL = 20, kIQ4_XS = 23 };  // IQ4_NL / IQ4_XS: ggml_rows_iq4.h
// A type's blocks repacked at load for the row kernels (type | kRepacked; same bytes per eight rows, same bits):
// Q4_1_R8, below (Rows8R8); Q4_K_R8, ggml_rows8_k.h; Q6_K_R8, ggml_rows8_q6k.h; Q8_0_R16 (sixteen rows a group, read
// only by the x16 rows: Rows16X16).
constexpr int kRepacked = 0x100;
constexpr int kQ4_1_R8 = kQ4_1 | kRepacked;
constexpr int kQ8_0_R16 = kQ8_0 | kRepacked;
constexpr int kQ4_K_R8 = kQ4_K | kRepacked;
constexpr int kQ6_K_R8 = kQ6_K | kRepacked;

inline bool is_k_quant(int type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kQ4_K_R8 || type == kQ6_K_R8;
}

// Bytes of one row of `nb` blocks of 32 values (K-quants: nb a multiple of 8, super-blocks of 256).
inline int64_t row_bytes(int type, int64_t nb) {
  switch (type) {
    case kQ4_0: return nb * 18;
    case kQ4_1:
    case kQ4_1_R8: return nb * 20;
    case kQ5_0: return nb * 22;
    case kQ5_1: return nb * 24;
    case kQ8_0:
    case kQ8_0_R16: return nb * 34;
    case kQ4_K:
    case kQ4_K_R8: return nb / 8 * 144;
    case kQ5_K: return nb / 8 * 176;
    case kQ6_K:
    case kQ6_K_R8: return nb / 8 * 210;
    case kIQ4_NL: return nb * 18;
    case kIQ4_XS: return nb % 8 ? 0 : nb / 8 * 136;  // whole super-blocks only
    default: return 0;
  }
}

struct alignas(8) BlockX {
  float d, s;  // step, and step * sum(q)
  int8_t q[kBlock];
};

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One token: x [K] -> xq [K / 32]. A block holding NaN or Inf gets d = NaN.
inline void quantize(const float* x, int64_t nb, BlockX* xq) {
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    const float top = blk.top;
    const bool finite = blk.finite;
    BlockX& o = xq[b];
    if (!finite || top == 0.0f) {
      o.d = finite ? 0.0f : std::nanf("");
      o.s = o.d;
      std::memset(o.q, 0, kBlock);
      continue;
    }
    const __m256 inv = _mm256_set1_ps(127.0f / top);
    __m256i q[4];  // values 8j .. 8j + 7, |q| <= 127
    for (int j = 0; j < 4; ++j) q[j] = localmoe::round_scaled(blk.v[j], inv);
    // to bytes in registers (the saturating packs are exact at |q| <= 127; one permute undoes their lane interleave)
    // and the integer sum in any order (exact): the same bytes as storing and summing the codes one at a time, in
    // 0.40x the time (16 tokens of 576 or 1536, Zen 4: benchmarks/q41_rows.cpp)
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    o.d = top / 127.0f;
    o.s = o.d * static_cast<float>(_mm_cvtsi128_si32(s));
  }
}

// K-quant rows read x rounded per super-block of 256 values (llama.cpp's Q8_K): one step d = amax / 127 for
// the 256, q = round-to-even(x / d), and the sum of q per 32 values (exact in fp32) for the Q4_K / Q5_K mins.
// A super-block's dot product is then one integer sum with the weight's sub-block scales multiplied in
// (vpmaddubsw, vpmaddwd by the scale: exact in int32), converted once: one FMA by d_w * d_x per 256 values
// where the per-32 form had eight dependent FMAs (one token, one Zen 4 core, 32768 x 1024: Q4_K 9.9 -> 16.0 GB/s,
// Q5_K 6.6 -> 15.7, Q6_K 2.2 -> 22.7 with the rows no longer paired; the exact-x Q6_K row: 8.3).
constexpr int64_t kSuper = 256;

// q first and the block 32-byte aligned: every 32-value load of q stays inside one cache line (after d, sums and
// sums16 (68 bytes) every other one crossed a line: the one-token Q6_K row ran ~1.1-1.2x slower).
struct alignas(32) BlockXK {
  int8_t q[kSuper];
  float d;
  float sums[8];      // sum of q over values 32j .. 32j + 31 (Q4_K / Q5_K mins)
  int16_t sums16[16];  // over values 16i .. 16i + 15 (Q6_K's -32)
};

// One token: x [K] -> xq [K / 256]. A super-block holding NaN or Inf gets d = NaN.
inline void quantize_k(const float* x, int64_t nsb, BlockXK* xq) {
  for (int64_t b = 0; b < nsb; ++b) {
    localmoe::Block32 blk[8];
    float top = 0.0f;
    bool finite = true;
    for (int j = 0; j < 8; ++j) {
      blk[j] = localmoe::load_block32(x + b * kSuper + j * kBlock);
      top = std::max(top, blk[j].top);
      finite = finite && blk[j].finite;
    }
    BlockXK& o = xq[b];
    if (!finite || top == 0.0f) {
      o.d = finite ? 0.0f : std::nanf("");
      std::memset(o.q, 0, kSuper);
      std::memset(o.sums16, 0, sizeof(o.sums16));
      for (int j = 0; j < 8; ++j) o.sums[j] = 0.0f;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(127.0f / top);
    for (int j = 0; j < 8; ++j) {
      int32_t half_sums[2] = {0, 0};
      for (int v = 0; v < 4; ++v) {
        alignas(32) int32_t q[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), localmoe::round_scaled(blk[j].v[v], inv));
        for (int i = 0; i < 8; ++i) {
          o.q[32 * j + 8 * v + i] = static_cast<int8_t>(q[i]);
          half_sums[v / 2] += q[i];
        }
      }
      o.sums16[2 * j] = static_cast<int16_t>(half_sums[0]);
      o.sums16[2 * j + 1] = static_cast<int16_t>(half_sums[1]);
      o.sums[j] = static_cast<float>(half_sums[0] + half_sums[1]);
    }
    o.d = top / 127.0f;
  }
}

// The fifth bits of 32 values as bytes: 16 where bit i of the 32-bit field at `qh` is set, else 0.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  // byte i takes byte i / 8 of the field (set1 repeats it in both 128-bit lanes), then bit i % 8 of it
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}

// u8 x s8 products summed 4 at a time into int32 lanes: vpdpbusd with AVX-512 VNNI, vpmaddubsw +
// vpmaddwd on AVX2. The same sums on both (every caller keeps |u s + u' s'| < 2^15, so vpmaddubsw does
// not saturate), hence the same bits after the fp32 steps.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Q4_K: super-blocks of 256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles; sub-block j (32 values) is d sc[j] q - dmin m[j], and bytes 32p..32p+31 hold
// sub-block 2p in their low nibbles, 2p + 1 in their high ones. One 32-byte load feeds two of x's
// int8 blocks; the mins come in through d * sum(q) of x, as Q4_1's m.
// Scales j = 0-3: low 6 bits of bytes 0-3, mins: of bytes 4-7; j = 4-7: the nibbles of bytes 8-11 with the top
// two bits of bytes 0-3 (scales) and 4-7 (mins), four at a time in 32-bit words (llama.cpp's masks).
// Byte j of sc / mn: sub-block j's scale / min. Kept in registers: through memory (four 32-bit stores read back
// as 8-byte loads) the one-token Q4_K row ran ~1.1-1.3x slower (store forwarding fails).
inline void q4_k_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint64_t out0 = w[0] & 0x3F3F3F3Fu, out1 = (w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4);
  const uint64_t out2 = w[1] & 0x3F3F3F3Fu, out3 = ((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4);
  sc = out0 | out1 << 32;
  mn = out2 | out3 << 32;
}

// The super-block's d sc[j] and dmin m[j] for j = 0..7 as floats: the same numbers as the scalar products
// (a 6-bit integer converts exactly; one IEEE multiply each), eight at a time.
inline void q4_k_steps(const uint8_t* blk, float step[8], float mins[8]) {
  uint64_t sc, mn;
  q4_k_scales(blk + 4, sc, mn);
  const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
  _mm256_storeu_ps(step, _mm256_mul_ps(_mm256_set1_ps(half(blk)), s));
  _mm256_storeu_ps(mins, _mm256_mul_ps(_mm256_set1_ps(half(blk + 2)), m));
}

// Q6_K: super-blocks of 256 values, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8
// scales, fp16 d; value = d scale[v / 16] (q - 32). Value 32c + i (c < 8, i < 32; c = 4h + s) takes
// its low bits from ql[64h + 32(s & 1) + i] (low nibble for s < 2, high for s >= 2) and its high bits
// from (qh[32h + i] >> 2s) & 3. `q6_k_codes` rebuilds q - 32 (signed) for values 32c..32c + 31.
inline __m256i q6_k_codes(const uint8_t* blk, int c) {
  const int h = c >> 2, s = c & 3;
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (s & 1)));
  lo = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)),
                       _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));  // -32..31
}

// Rows against int8 x, for up to kTile tokens at once: each unit of a row (a block of 32, or a K-quant
// super-block of 256) is decoded once into registers and applied to every token of the tile. Blocks of
// 32 (the K-quants: rows8k / rows8q6k, against x per 256), per token and block: an exact integer dot product in 8 int32 lanes, then acc = fma(float(dot),
// step_w * d_x, acc) in those lanes, and corr = fma(factor_w, d_x * sum(q_x), corr) (the factor
// brings in Q4_0's -8, Q4_1's m, the K-quants' mins; corr's lanes are the tile's tokens); finally
// y = hsum(acc) + corr. A token's operations do not depend on N or on the tokens beside it (a batched
// sequence decodes with the same bits as alone), nor on the ISA (the integer sums are exact on both).

// Tokens per tile: their accumulators stay in registers (AVX-512 has 32 vector registers, AVX2 16).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kTile = 8;
#else
constexpr int kTile = 4;
#endif

// x as the int8 rows read it: the blocks [N, nb], and each block's d * sum(q) transposed, [nb, padded]
// with padded = N rounded up to 8 (zero past N), so that a tile's tokens load as one vector.
// K-quant rows read `kblocks` [N, nb / 8] instead (BlockXK), x16 rows `blocks16` [N, nb] (BlockX16).
struct BlockX16;
struct XQ {
  const BlockX* blocks;
  const float* s;
  int64_t nb, padded;
  const BlockXK* kblocks;
  const BlockX16* blocks16;
};

// A tile of tokens t0 .. t0 + TN - 1: their blocks, and XQ.s from t0 on (K-quant rows: their super-blocks, k).
struct Tile {
  const BlockX* x[kTile];
  const float* s;  // XQ.s + t0
  int64_t padded;
  const BlockXK* k[kTile];
};

// step_w * d_x for token t's block as a vector.
inline __m256 scaled(__m256 step, const BlockX& x) { return _mm256_mul_ps(step, _mm256_broadcast_ss(&x.d)); }

inline void add_dot(__m256& acc, __m256i dot, __m256 scale) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: units of one block of 32.
template <int T>
struct Block32Int8 {
  static constexpr int64_t kBytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : 34;
  static constexpr int64_t kCodes = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;  // offset of the nibbles
  static constexpr int64_t kBlocks = 1;
  template <int TN>
  __attribute__((always_inline)) static void unit(const uint8_t* blk, const Tile& x, int64_t u, __m256* acc, __m256& corr) {
    const float d = half(blk);
    const __m256 step = _mm256_set1_ps(d);
    __m256i w;
    if (T == kQ8_0) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes));
      const __m128i lo = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
      if (T == kQ5_0 || T == kQ5_1) w = _mm256_or_si256(w, fifth_bits(blk + kCodes - 4));
      const float factor = T == kQ4_0 ? -8.0f * d : T == kQ5_0 ? -16.0f * d : half(blk + 2);  // Q4_1, Q5_1: m
      corr = _mm256_fmadd_ps(_mm256_set1_ps(factor), _mm256_loadu_ps(x.s + u * x.padded), corr);
    }
    const __m256i magnitude = T == kQ8_0 ? _mm256_sign_epi8(w, w) : w;  // Q8_0: |w| against x with w's sign
#pragma GCC unroll 8
    for (int t = 0; t < TN; ++t) {
      const BlockX& xb = x.x[t][u];
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      if (T == kQ8_0) xq = _mm256_sign_epi8(xq, w);
      add_dot(acc[t], dot_u8s8(magnitude, xq), scaled(step, xb));  // |pair| <= 2 * 128 * 127
    }
  }
};

// acc + the int16 pairs of p times s summed into int32 lanes: vpdpwssd with AVX-512 VNNI, vpmaddwd + vpaddd on AVX2
// (the same wrapping integer sums, hence the same bits).
inline __m256i madd_add(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

// Q6_K: the unsigned codes q (0..63) against x (vpmaddubsw: |pair| <= 2 * 63 * 127), the two 16-value halves
// of a 32-value chunk get their int8 scales in one vpmaddwd (madd_add); the -32 comes in as 32 sum_i scale[i] sum(x_i)
// over x's 16-value sums (llama.cpp's way); per token one int32 sum per super-block, one FMA by d_w d_x (the rows:
// ggml_rows8_q6k.h). q6_k_unsigned4: the four chunks 4h .. 4h + 3 that share qh[32h ..] and ql[64h ..], with llama.cpp's masks (the high
// bits masked in place, then shifted: 17 operations for four chunks where a shift per chunk took 21). One token keeps
// two chains of integer sums (a single vpdpwssd chain waited on its latency; the sum is exact in any order): with both,
// 1.2x from cache and 1.1x from memory (32768 x 1024, Zen 4), same bits.
inline void q6_k_unsigned4(const uint8_t* blk, int h, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
  q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(0xC0))), 2));
}

// One token's Q4_K / Q5_K rows from memory (group8_qk_one): each row's bytes are fetched kAheadRows rows before they are
// read (into L1; past the matrix's end they fetch bytes no one reads, which cannot fault). The hardware prefetcher alone
// left a matrix of a few hundred KB (an expert's, the attention's) at 11-15 GB/s one token against ~25 from cache; 16
// rows ahead gave 1.04-1.29x from memory, 0.95x from cache (Zen 4, load 5-8). Same bits. (Q6_K's one-row loop gained
// nothing from it: 0.93-1.0x.)
constexpr int64_t kAheadRows = 16;
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0);
}

// A group of n rows is n * stride contiguous bytes, read as n interleaved streams, which defeated the hardware
// prefetcher on matrices past L2: the group kernels fetch the next group's bytes (into L1) while this one runs, a share
// of them per block. Past the matrix's end they fetch bytes no one reads, which cannot fault. No value depends on it.
struct NextGroup {
  const uint8_t* next;
  int64_t per_block;  // lines of the next group per block
  NextGroup(const uint8_t* row0, int64_t n, int64_t stride, int64_t nb)
      : next(row0 + n * stride), per_block((n * stride + 64 * nb - 1) / (64 * nb)) {}
  __attribute__((always_inline)) void fetch(int64_t b) const {
    for (int64_t l = 0; l < per_block; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * (b * per_block + l)), _MM_HINT_T0);
  }
};

// Rows eight at a time, one dispatch for every group kernel (rows8: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 on int8 x;
// rows8k: Q4_K / Q5_K, ggml_rows8_k.h; rows8_f32: Q8_0 on fp32 x). A group kernel G supplies
//   X                        a token's x as the kernel reads it (BlockX, BlockXK, float)
//   kTile                    tokens per tile
//   group<TN>(row0, stride, units, x, y, ldy, bias)   rows row0 .. row0 + 7 against TN tokens into y[t * ldy + 0..8)
//   wide<TN>(w, stride, units, x, r0, r1, y, ldy, bias) -> r   the rows it takes in wider groups from r0 on (or r0)
//   single(row, units, x)    one row against one token: the value `group` gives that (row, token)
// rows_fixed runs groups of eight from r0 on and the leftover rows alone; one function per (G, TN), not inlined into
// its caller: with the token count dispatched inside the row loop, GCC compiled the one-token group into the same
// body as the 16-token one and it ran ~3x slower. rows_tokens picks it for a run-time n <= TN. (Timed against the
// three copies it replaces: benchmarks/ggml_gemm.py, same rates.)
template <class G, int TN>
__attribute__((noinline)) void rows_fixed(const uint8_t* w, int64_t stride, int64_t units,
                                          const typename G::X* const* x, int64_t r0, int64_t r1, float* y, int64_t ldy,
                                          const float* bias) {
  int64_t r = G::template wide<TN>(w, stride, units, x, r0, r1, y, ldy, bias);
  for (; r + 8 <= r1; r += 8)
    G::template group<TN>(w + r * stride, stride, units, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
  for (; r < r1; ++r)
    for (int t = 0; t < TN; ++t) {
      const float v = G::single(w + r * stride, units, x[t]);
      y[t * ldy + r] = bias == nullptr ? v : v + bias[r];
    }
}

template <class G, int TN = G::kTile>
inline void rows_tokens(const uint8_t* w, int64_t stride, int64_t units, const typename G::X* const* x, int n,
                        int64_t r0, int64_t r1, float* y, int64_t ldy, const float* bias) {
  if constexpr (TN > 1)
    if (n < TN) return rows_tokens<G, TN - 1>(w, stride, units, x, n, r0, r1, y, ldy, bias);
  rows_fixed<G, TN>(w, stride, units, x, r0, r1, y, ldy, bias);
}

// No wider groups (rows_fixed starts its groups of eight at r0).
struct NoWide {
  template <int TN, class X>
  static int64_t wide(const uint8_t*, int64_t, int64_t, const X* const*, int64_t r0, int64_t, float*, int64_t,
                      const float*) {
    return r0;
  }
};

// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows eight at a time ("rows8"): a block of 32 of eight consecutive weight rows is
// transposed once into eight vectors, vector i holding in lane r the codes 4i..4i+3 of row r, and every token of a
// tile then takes one vpdpbusd per vector against its x codes 4i..4i+3 broadcast (AVX2: vpmaddubsw + vpmaddwd):
// lane r ends with row r's exact integer dot product of the block, so the conversion and the two FMAs that follow
// serve eight rows at once, where the per-row form (Block32Int8) spent them on one row's 8 partial lanes. Per
// (row, token) the value is, over the blocks b in order,
//   acc = fma(float(sum_j q_w q_x), d_w * d_x, acc);  acc = fma(f_w, d_x * sum_j q_x, acc)
// (f: Q4_0 -8 d, Q5_0 -16 d, Q4_1 / Q5_1 m; Q8_0 has no second FMA), then + bias: one fp32 chain per (row, token),
// the same whether the row is computed in a group of eight or alone (rows8_single, for a range's leftover rows),
// whatever the tokens beside it and on both ISAs (the integer sums are exact). Q5_0 / Q5_1 joined in session 7 (one
// token from cache, Zen 4: 19.5-20 GB/s against 12.5-13.5 per row), which changed their bits. Q8_0 on VNNI: vpdpbusd
// multiplies u8 by s8, so x comes in as x + 128 (u8) against the signed codes and 128 * sum(q_w) (from the same
// transposition) starts the sum; AVX2 moves w's sign onto x. (Q4_K / Q5_K: rows8k, ggml_rows8_k.h.)
inline bool has_rows8(int type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0 || type == kQ4_K ||
         type == kQ5_K || type == kQ6_K || type == kQ4_1_R8 || type == kQ4_K_R8 || type == kQ6_K_R8 || type == kIQ4_NL ||
         type == kIQ4_XS || type == kQ8_0_R16;
}

// Tokens per tile of rows8: their accumulators (one vector each) stay in registers beside the eight code vectors.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kTile8 = 16;
constexpr bool kVnni = true;
#else
constexpr int kTile8 = 4;
constexpr bool kVnni = false;
#endif

// Eight rows' block of 32, transposed (see above). codes[i] lane r: row r's codes 4i..4i+3 (Q4: 0..15; Q5: 0..31;
// Q8_0: signed); d: the rows' steps; f: Q4_0 -8 d, Q5_0 -16 d, Q4_1 / Q5_1 m; bias8: Q8_0 on VNNI -128 sum(q_w),
// else unused.
struct Block8 {
  __m256i codes[8];
  __m256 d, f;
  __m256i bias8;
};

// The 8 dwords at p + r * stride (r = 0..7) as one vector.
inline __m256i gather8(const uint8_t* p, int64_t stride) {
  int32_t v[8];
  for (int r = 0; r < 8; ++r) std::memcpy(v + r, p + r * stride, 4);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
}

// The low (hi = false) or high 16 bits of each of 8 dwords, as fp16 -> fp32.
inline __m256 halves8(__m256i dwords, bool hi) {
  const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                             2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                          : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dwords, pick), 0x08);  // qwords 0, 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// Four vectors a[k] (lanes 0-3: rows 0-3, 4-7: rows 4-7, each 128-bit lane one row's 4 dwords) -> out[k] lane r =
// dword k of row r.
inline void transpose4(const __m256i a[4], __m256i out[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpacklo_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_unpackhi_epi32(a[0], a[1]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t1);
  out[1] = _mm256_unpackhi_epi64(t0, t1);
  out[2] = _mm256_unpacklo_epi64(t2, t3);
  out[3] = _mm256_unpackhi_epi64(t2, t3);
}

// Q8_0: the signed codes of eight rows' block (at blk, rows `stride` apart) transposed as Block8.codes.
__attribute__((always_inline)) inline void q8_0_codes8(const uint8_t* blk, int64_t stride, __m256i codes[8]) {
  // rows r and r + 4 in one vector per 16-byte half, then dwords transposed within each half
  __m256i lo[4], hi[4];
  for (int r = 0; r < 4; ++r) {
    const uint8_t* a = blk + r * stride + 2;
    const uint8_t* b = blk + (r + 4) * stride + 2;
    lo[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b), reinterpret_cast<const __m128i*>(a));
    hi[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + 16), reinterpret_cast<const __m128i*>(a + 16));
  }
  transpose4(lo, codes);
  transpose4(hi, codes + 4);
}

// Q4_1_R8 (Q4_1 repacked at load, repack_q41 below): eight rows' block of 32 as 160 bytes, the rows' (d, m) dwords
// (what gather8 reads), then the four vectors transpose4 makes of their nibbles (lane r: row r's code bytes 4k..4k+3),
// so a group of eight rows is read with five loads and no transposition; the same values as the GGUF layout, hence
// the same bits on every path. Block b of the group starting at row0 lies at row0 + b * kQ41R8Block.
constexpr int64_t kQ41R8Block = 8 * 20;
__attribute__((always_inline)) inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// R8: blk is a Q4_1_R8 block (stride unused).
template <int T, bool R8 = false>
__attribute__((always_inline)) inline void load_block8(const uint8_t* blk, int64_t stride, Block8& o) {
  static_assert(!R8 || T == kQ4_1, "Q4_1_R8 only");
  const __m256i head = R8 ? load32(blk) : gather8(blk, stride);  // fp16 d, then Q4_1's fp16 m (Q4_0 / Q8_0: codes)
  o.d = halves8(head, false);
  if (T == kQ8_0) {
    q8_0_codes8(blk, stride, o.codes);
    if (kVnni) {
      __m256i s = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) s = _mm256_dpbusd_epi32(s, _mm256_set1_epi8(static_cast<char>(0x80)), o.codes[i]);
      o.bias8 = _mm256_sub_epi32(_mm256_setzero_si256(), s);
    }
    return;
  }
  constexpr int kCodes = Block32Int8<T>::kCodes;
  o.f = T == kQ4_0 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), o.d)
        : T == kQ5_0 ? _mm256_mul_ps(_mm256_set1_ps(-16.0f), o.d) : halves8(head, true);
  __m256i rows[4], dw[4];
  if constexpr (R8) {
    for (int k = 0; k < 4; ++k) dw[k] = load32(blk + 32 + 32 * k);
  } else {
    for (int r = 0; r < 4; ++r)
      rows[r] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk + (r + 4) * stride + kCodes),
                                    reinterpret_cast<const __m128i*>(blk + r * stride + kCodes));
    transpose4(rows, dw);
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    o.codes[k] = _mm256_and_si256(dw[k], low4);                              // values 4k..4k+3
    o.codes[k + 4] = _mm256_and_si256(_mm256_srli_epi16(dw[k], 4), low4);  // values 16+4k.. = 4(k+4)..
  }
  if (T == kQ5_0 || T == kQ5_1) {
    // the fifth bits (the 32-bit field before the nibbles, bit v for value v): byte j of lane r of codes[i] takes bit
    // 4i + j of row r's field as 16. Byte m of each lane's field copied to its four bytes (one vpshufb for codes 2m
    // and 2m + 1), masked by (1, 2, 4, 8) or (16, 32, 64, 128) per byte and compared (llama.cpp's bytes_from_bits):
    // four operations a vector (a multiply spreading each nibble took five: 15 against 20 GB/s, one token, Zen 4).
    const __m256i qh = gather8(blk + kCodes - 4, stride);
    const __m256i masks[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32(static_cast<int>(0x80402010u))};
    for (int m = 0; m < 4; ++m) {
      const __m256i rep = _mm256_shuffle_epi8(qh, _mm256_set_epi8(
          12 + m, 12 + m, 12 + m, 12 + m, 8 + m, 8 + m, 8 + m, 8 + m, 4 + m, 4 + m, 4 + m, 4 + m, m, m, m, m,
          12 + m, 12 + m, 12 + m, 12 + m, 8 + m, 8 + m, 8 + m, 8 + m, 4 + m, 4 + m, 4 + m, 4 + m, m, m, m, m));
      for (int h = 0; h < 2; ++h) {
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(rep, masks[h]), masks[h]);
        o.codes[2 * m + h] = _mm256_or_si256(o.codes[2 * m + h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
    }
  }
}

// x codes 4i..4i+3 of a block in every lane (one load).
inline __m256i codes4(const int8_t* q, int i) { return _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * i)); }

// Lane r: the exact integer dot product of row r's block with one token's codes q (32 int8); `chains` independent
// partial sums (a lone token's eight dependent vpdpbusd would wait on each other; integer sums: any order is exact).
template <int T, int chains>
__attribute__((always_inline)) inline __m256i dot8(const Block8& w, const int8_t* q) {
  __m256i s[chains];
  for (int c = 0; c < chains; ++c) s[c] = _mm256_setzero_si256();
  if constexpr (kVnni) {
    if (T == kQ8_0) {
      s[0] = w.bias8;
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int i = 0; i < 8; ++i)
        s[i % chains] = _mm256_dpbusd_epi32(s[i % chains], _mm256_xor_si256(codes4(q, i), flip), w.codes[i]);
    } else {
      for (int i = 0; i < 8; ++i) s[i % chains] = _mm256_dpbusd_epi32(s[i % chains], w.codes[i], codes4(q, i));
    }
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 8; ++i) {
      const __m256i x = codes4(q, i);
      const __m256i p = T == kQ8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w.codes[i], w.codes[i]),
                                                          _mm256_sign_epi8(x, w.codes[i]))
                                   : _mm256_maddubs_epi16(w.codes[i], x);
      s[i % chains] = _mm256_add_epi32(s[i % chains], _mm256_madd_epi16(p, ones));
    }
  }
  for (int c = 1; c < chains; ++c) s[0] = _mm256_add_epi32(s[0], s[c]);
  return s[0];
}

// Rows r .. r + 7 against TN tokens (x[t]: token t's blocks): y[t * ldy + r ..] = the eight values (+ bias). R8:
// row0 starts a Q4_1_R8 group.
template <int T, int TN, bool R8 = false>
inline void group8(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX* const* x, float* y, int64_t ldy,
                   const float* bias) {
  constexpr int64_t kBytes = R8 ? kQ41R8Block : Block32Int8<T>::kBytes;
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  const NextGroup ahead(row0, 8, stride, nb);  // the next group's rows, fetched while this one runs
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    Block8 w;
    load_block8<T, R8>(row0 + b * kBytes, stride, w);
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const BlockX& xb = x[t][b];
      const __m256 dot = _mm256_cvtepi32_ps(dot8<T, (TN < 4 ? 4 / TN : 1)>(w, xb.q));
      acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(w.d, _mm256_broadcast_ss(&xb.d)), acc[t]);
      if (T != kQ8_0) acc[t] = _mm256_fmadd_ps(w.f, _mm256_broadcast_ss(&xb.s), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Rows r .. r + 15 against TN tokens, as group8 for two groups of eight in one 512-bit vector per code dword (lanes
// 0-7: rows r..r+7, 8-15: rows r+8..r+15): each token's x dword is broadcast once for sixteen rows and its scale
// products, conversion and FMAs serve sixteen; per lane the same operations in the same order as group8 (same bits).
inline __m512 join8(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m512i join8(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline int32_t load_u32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_1_R8's sixteen rows r .. r + 15 (two groups of eight, lo at row0, hi 8 rows on) as group16's vectors: five
// 512-bit loads, two fp16 conversions, no transposition (the values load_block8 gives each half).
__attribute__((always_inline)) inline void load_r8_16(const uint8_t* lo, const uint8_t* hi, __m512i codes[8], __m512& d,
                                                     __m512& m) {
  const auto join = [](const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
  };
  const __m512i head = join(lo, hi);  // lane r: row r's fp16 d (low half), fp16 m (high half)
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
  m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i dw = join(lo + 32 + 32 * k, hi + 32 + 32 * k);
    codes[k] = _mm512_and_si512(dw, low4);
    codes[k + 4] = _mm512_and_si512(_mm512_srli_epi16(dw, 4), low4);
  }
}

// R8: row0 starts a Q4_1_R8 group (the next group of eight, 8 rows on, is the high half).
template <int T, int TN, bool R8 = false>
inline void group16(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX* const* x, float* y, int64_t ldy,
                    const float* bias) {
  constexpr int64_t kBytes = R8 ? kQ41R8Block : Block32Int8<T>::kBytes;
  constexpr int kChains = 2;  // integer partial sums per token: exact in any order (one chain measured ~4% slower)
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(row0, 16, stride, nb);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    __m512i codes[8];
    __m512 d, f;
    __m512i bias8 = _mm512_setzero_si512();
    if constexpr (R8) {
      load_r8_16(row0 + b * kBytes, row0 + 8 * stride + b * kBytes, codes, d, f);
    } else {
      Block8 lo, hi;
      load_block8<T>(row0 + b * kBytes, stride, lo);
      load_block8<T>(row0 + 8 * stride + b * kBytes, stride, hi);
      for (int i = 0; i < 8; ++i) codes[i] = join8(lo.codes[i], hi.codes[i]);
      d = join8(lo.d, hi.d);
      f = T == kQ8_0 ? d : join8(lo.f, hi.f);
      if (T == kQ8_0) bias8 = join8(lo.bias8, hi.bias8);
    }
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const BlockX& xb = x[t][b];
      __m512i s[2] = {bias8, _mm512_setzero_si512()};
      if (T == kQ8_0) {
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
        for (int i = 0; i < 8; ++i)
          s[i % kChains] = _mm512_dpbusd_epi32(
              s[i % kChains], _mm512_xor_si512(_mm512_set1_epi32(load_u32(xb.q + 4 * i)), flip), codes[i]);
      } else {
        for (int i = 0; i < 8; ++i)
          s[i % kChains] = _mm512_dpbusd_epi32(s[i % kChains], codes[i], _mm512_set1_epi32(load_u32(xb.q + 4 * i)));
      }
      if (kChains == 2) s[0] = _mm512_add_epi32(s[0], s[1]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
      if (T != kQ8_0) acc[t] = _mm512_fmadd_ps(f, _mm512_set1_ps(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}
#endif

// One row against one token (x: its blocks): the value group8 gives that (row, token), computed alone.
template <int T>
inline float rows8_single(const uint8_t* row, int64_t nb, const BlockX* x) {
  constexpr int64_t kBytes = Block32Int8<T>::kBytes;
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const BlockX& xb = x[b];
    const float d = half(blk);
    __m256i w;
    if (T == kQ8_0) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      constexpr int64_t kCodes = Block32Int8<T>::kCodes;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes));
      const __m128i lo = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
      if (T == kQ5_0 || T == kQ5_1) w = _mm256_or_si256(w, fifth_bits(blk + kCodes - 4));
    }
    __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
    if (T == kQ8_0) xq = _mm256_sign_epi8(xq, w);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), dot_u8s8(T == kQ8_0 ? _mm256_sign_epi8(w, w) : w, xq));
    int32_t dot = 0;
    for (int i = 0; i < 8; ++i) dot += lanes[i];
    const float scale = d * xb.d;
    acc = std::fma(static_cast<float>(dot), scale, acc);
    if (T != kQ8_0) {
      const float f = T == kQ4_0 ? -8.0f * d : T == kQ5_0 ? -16.0f * d : half(blk + 2);
      acc = std::fma(f, xb.s, acc);
    }
  }
  return acc;
}

// rows8 as a group kernel for rows_fixed; on AVX-512 VNNI a tile of 2 or more tokens takes sixteen rows at a time
// first (one token: group8's eight independent chains keep its ports busier).
template <int T>
struct Rows8 {
  using X = BlockX;
  static constexpr int kTile = kTile8;
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nb, const BlockX* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    int64_t r = r0;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (TN > 1)
      for (; r + 16 <= r1; r += 16)
        group16<T, TN>(w + r * stride, stride, nb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
#endif
    return r;
  }
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nb,
                                                   const BlockX* const* x, float* y, int64_t ldy, const float* bias) {
    group8<T, TN>(row0, stride, nb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nb, const BlockX* x) { return rows8_single<T>(row, nb, x); }
};

// Q4_1_R8 as a group kernel for rows_fixed: `wide` takes every row of the range, sixteen at a time where a tile of 2 or
// more tokens runs on AVX-512 VNNI (as Rows8), else eight; a group the range cuts is computed whole into a buffer and
// the range's rows copied out (a repacked row cannot be read alone; ggml_rows8_k.h WholeGroups for the K-quants).
template <int T>
struct Rows8R8 {
  using X = BlockX;
  static constexpr int kTile = kTile8;
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nb, const BlockX* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    for (int64_t r = r0; r < r1;) {
      const int64_t g = r / 8 * 8;
      const float* b = bias == nullptr ? nullptr : bias + r;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      if constexpr (TN > 1)
        if (g == r && r + 16 <= r1) {
          group16<T, TN, true>(w + r * stride, stride, nb, x, y + r, ldy, b);
          r += 16;
          continue;
        }
#endif
      if (g == r && r + 8 <= r1) {
        group8<T, TN, true>(w + r * stride, stride, nb, x, y + r, ldy, b);
        r += 8;
        continue;
      }
      float part[8 * TN];
      group8<T, TN, true>(w + g * stride, stride, nb, x, part, 8, nullptr);
      for (const int64_t end = std::min(r1, g + 8); r < end; ++r)
        for (int t = 0; t < TN; ++t)
          y[t * ldy + r] = bias == nullptr ? part[8 * t + r - g] : part[8 * t + r - g] + bias[r];
    }
    return r1;
  }
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nb,
                                                   const BlockX* const* x, float* y, int64_t ldy, const float* bias) {
    group8<T, TN, true>(row0, stride, nb, x, y, ldy, bias);
  }
  static float single(const uint8_t*, int64_t, const BlockX*) { return std::nanf(""); }  // never: wide takes all
};

// Q4_1 rows [O, nb * 20] (O a multiple of 8) into Q4_1_R8 (`pack`) or back; src may be dst (one group at a time through
// `tmp`, 8 * nb * 20 bytes).
inline void repack_q41(const uint8_t* src, uint8_t* dst, int64_t O, int64_t nb, bool pack, uint8_t* tmp) {
  const int64_t group = 8 * nb * 20;
  for (int64_t g = 0; g < O / 8; ++g) {
    std::memcpy(tmp, src + g * group, group);
    uint8_t* out = dst + g * group;
    for (int r = 0; r < 8; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* plain = (pack ? tmp : out) + r * nb * 20 + b * 20;
        uint8_t* packed = (pack ? out : tmp) + b * kQ41R8Block;
        for (int k = 0; k < 5; ++k) {  // dword 0: d, m; dwords 1-4: the code bytes 4(k - 1) ..
          uint8_t* at = packed + (k == 0 ? 0 : 32 * k) + 4 * r;
          if (pack) std::memcpy(at, plain + 4 * k, 4);
          else std::memcpy(plain + 4 * k, at, 4);
        }
      }
  }
}

}  // namespace localmoe_ggml

#include "ggml_rows8_k.h"  // Q4_K and Q5_K eight rows at a time (rows8k)
#include "ggml_rows8_q6k.h"  // Q6_K eight rows at a time (rows8q6k)
#include "ggml_rows_iq4.h"  // IQ4_NL and IQ4_XS rows (RowsIQ4)

namespace localmoe_ggml {

// One weight row against TN tokens of int8 x: out[t] = row . x[t].
template <class U, int TN>
inline void dot_tokens_int8(const uint8_t* row, int64_t units, const Tile& x, float* out) {
  __m256 acc[TN];
  __m256 corr = _mm256_setzero_ps();
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) U::template unit<TN>(row + u * U::kBytes, x, u, acc, corr);
  alignas(32) float c[8];
  _mm256_store_ps(c, corr);
  for (int t = 0; t < TN; ++t) out[t] = hsum(acc[t]) + c[t];
}

// Rows r0..r1 of W (rows of row_bytes) against ONE token of int8 x, into y[r0..r1), one row at a time. (Pairing
// rows to overlap two FMA chains paid while K-quant rows did eight dependent FMAs per super-block; with one FMA
// per super-block (integer scale products) pairing made Q4_K / Q5_K 2x and Q6_K ~8x slower, measured on Zen 4.)
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: rows8, eight rows at a time; Q4_K / Q5_K: rows8k; Q6_K: rows8q6k.)
template <class U>
struct Rows8Type {
  static constexpr int kType = -1;
};
template <int T>
struct Rows8Type<Block32Int8<T>> {
  static constexpr int kType = T;
};

template <class U>
inline void rows_one_token(const uint8_t* w, int64_t row_bytes, int64_t units, const Tile& x, int64_t r0, int64_t r1,
                           float* y) {
  constexpr int T = Rows8Type<U>::kType;
  if constexpr (T >= 0) {
    rows_fixed<Rows8<T>, 1>(w, row_bytes, units, x.x, r0, r1, y, 0, nullptr);
  } else if constexpr (std::is_same_v<U, Rows8R8<kQ4_1>>) {
    rows_fixed<U, 1>(w, row_bytes, units, x.x, r0, r1, y, 0, nullptr);
  } else if constexpr (std::is_same_v<U, Rows8K> || std::is_same_v<U, Rows8K5> || std::is_same_v<U, Rows8K6> ||
                       std::is_same_v<U, Rows8KR8> || std::is_same_v<U, Rows8K6R8>) {  // K-quants
    rows_fixed<U, 1>(w, row_bytes, units, x.k, r0, r1, y, 0, nullptr);
  } else if constexpr (kIq4Rows<U>) {  // IQ4_NL / IQ4_XS
    rows_fixed<U, 1>(w, row_bytes, units, x.x, r0, r1, y, 0, nullptr);
  } else {
    for (int64_t r = r0; r < r1; ++r) dot_tokens_int8<U, 1>(w + r * row_bytes, units, x, y + r);
  }
}

// Rows against fp32 x (exact_x, for the lm_head, whose logits pick the token: engine/transformer.py):
// each block's codes widened to fp32 in registers once, then FMAs against every token's x (Q8_0: group8_f32 below,
// eight rows at a time); Q4_K's mins come in through each sub-block's sum of x.
inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline __m256 widen_s8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

struct Q4KF32 {
  static constexpr int64_t kBytes = 144;
  template <int TN>
  __attribute__((always_inline)) static void unit(const uint8_t* blk, const float* const* x, int64_t u, __m256* acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    alignas(32) float step[8], mins[8];
    q4_k_steps(blk, step, mins);
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p));
      const __m256i w[2] = {_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        const __m128i lo = _mm256_castsi256_si128(w[h]), hi = _mm256_extracti128_si256(w[h], 1);
        const __m256 w0 = widen_u8(lo), w1 = widen_u8(_mm_srli_si128(lo, 8));
        const __m256 w2 = widen_u8(hi), w3 = widen_u8(_mm_srli_si128(hi, 8));
        const __m256 dsc = _mm256_broadcast_ss(step + j), dmn = _mm256_broadcast_ss(mins + j);
#pragma GCC unroll 8
        for (int t = 0; t < TN; ++t) {
          const float* xj = x[t] + u * 256 + 32 * j;
          const __m256 x0 = _mm256_loadu_ps(xj), x1 = _mm256_loadu_ps(xj + 8);
          const __m256 x2 = _mm256_loadu_ps(xj + 16), x3 = _mm256_loadu_ps(xj + 24);
          __m256 qx = _mm256_mul_ps(w0, x0);
          qx = _mm256_fmadd_ps(w1, x1, qx);
          qx = _mm256_fmadd_ps(w2, x2, qx);
          qx = _mm256_fmadd_ps(w3, x3, qx);
          const __m256 sum_x = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
          acc[t] = _mm256_fmadd_ps(qx, dsc, acc[t]);
          acc[t] = _mm256_fnmadd_ps(sum_x, dmn, acc[t]);
        }
      }
    }
  }
};

struct Q6KF32 {
  static constexpr int64_t kBytes = 210;
  template <int TN>
  __attribute__((always_inline)) static void unit(const uint8_t* blk, const float* const* x, int64_t u, __m256* acc) {
    // d scale[i] for the 16 scales: one IEEE multiply each (an int8 converts exactly), 8 at a time
    alignas(32) float ds[16];
    const __m256 d = _mm256_set1_ps(half(blk + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    _mm256_store_ps(ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    for (int c = 0; c < 8; ++c) {
      const __m256i q = q6_k_codes(blk, c);
      const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
      const __m256 w0 = widen_s8(q0), w1 = widen_s8(_mm_srli_si128(q0, 8));
      const __m256 w2 = widen_s8(q1), w3 = widen_s8(_mm_srli_si128(q1, 8));
      const __m256 s0 = _mm256_broadcast_ss(ds + 2 * c), s1 = _mm256_broadcast_ss(ds + 2 * c + 1);
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const float* xc = x[t] + u * 256 + 32 * c;
        __m256 first = _mm256_mul_ps(w0, _mm256_loadu_ps(xc));  // values 0-15: scale 2c
        first = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), first);
        __m256 second = _mm256_mul_ps(w2, _mm256_loadu_ps(xc + 16));  // 16-31: scale 2c + 1
        second = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xc + 24), second);
        acc[t] = _mm256_fmadd_ps(first, s0, acc[t]);
        acc[t] = _mm256_fmadd_ps(second, s1, acc[t]);
      }
    }
  }
};

// Q8_0 rows against fp32 x (exact_x, the lm_head) eight at a time, in rows8's layout: the block's codes of eight rows
// transposed (load_block8), widened to fp32 per value j (lane r: row r's code j), then per token
// p[j % 4] = fma(w_j, x_j, p[j % 4]) over j in order, s = (p0 + p1) + (p2 + p3), acc = fma(s, d_w, acc): four
// FMAs per block and token for eight rows where a row at a time (as Q4KF32 still does) spent five on one. rows8_f32_single is the same chain for
// one row (a range's leftover rows); the four partial sums keep one token's chains short.
template <int TN>
inline void group8_f32(const uint8_t* row0, int64_t stride, int64_t nb, const float* const* x, float* y, int64_t ldy,
                       const float* bias) {
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  const NextGroup ahead(row0, 8, stride, nb);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    Block8 w;
    load_block8<kQ8_0>(row0 + b * 34, stride, w);
    __m256 p[TN][4];
    for (int t = 0; t < TN; ++t)
      for (int k = 0; k < 4; ++k) p[t][k] = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      __m256 wf[4];
      wf[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w.codes[i], 24), 24));
      wf[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w.codes[i], 16), 24));
      wf[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w.codes[i], 8), 24));
      wf[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(w.codes[i], 24));
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const float* xv = x[t] + 32 * b + 4 * i;
        for (int k = 0; k < 4; ++k) p[t][k] = _mm256_fmadd_ps(wf[k], _mm256_broadcast_ss(xv + k), p[t][k]);
      }
    }
    for (int t = 0; t < TN; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(p[t][0], p[t][1]), _mm256_add_ps(p[t][2], p[t][3])), w.d,
                               acc[t]);
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

inline float rows8_f32_single(const uint8_t* row, int64_t nb, const float* x) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 34 * b;
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < 32; ++j)
      p[j % 4] = std::fma(static_cast<float>(static_cast<int8_t>(blk[2 + j])), x[32 * b + j], p[j % 4]);
    acc = std::fma((p[0] + p[1]) + (p[2] + p[3]), half(blk), acc);
  }
  return acc;
}

// rows8_f32 as a group kernel for rows_fixed: tiles of 4 tokens (4 x 4 partial sums stay in registers).
struct Rows8F32 : NoWide {
  using X = float;
  static constexpr int kTile = 4;
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nb,
                                                   const float* const* x, float* y, int64_t ldy, const float* bias) {
    group8_f32<TN>(row0, stride, nb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nb, const float* x) { return rows8_f32_single(row, nb, x); }
};

// Q8_0 rows against x rounded to int16 per block of 32 (x16, the dense lm_head's default input: engine/transformer.py
// _head): step d = amax / 32767, q = round-to-even(x / d), so x keeps ~2^-16 of its block's largest value where int8
// x keeps 2^-8 (fp32 x: 2^-24). A block's dot product sum_j w_j q_j is an exact int32 (|w| <= 128, |q| <= 32767: under
// 2^27 over 32 values), vpdpwssd (AVX-512 VNNI) or vpmaddwd + vpaddd (AVX2) over int16 pairs; per (row, token), over
// the blocks in order,
//   acc = fma(float(dot), d_w * d_x, acc)
// then + bias: one fp32 chain, the same whether the row runs in a group of sixteen (AVX-512), of eight, or alone
// (rows8_x16_single), whatever tokens share the call, on both ISAs. The rows in rows8's layout: code vector i (lane r:
// row r's codes 4i..4i+3) widens to two int16 pair vectors, codes (4i, 4i + 2) and (4i + 1, 4i + 3), and x is stored
// with its pairs in that order, so a token's pair is one broadcast dword. Twice the int8 row's dot products for 256x
// finer x: the fp32-x row spends 32 FMAs per (row, block, token) where this spends two int16 dot products per 4 values.
// The same values also split into bytes, q = 256 h + l (l unsigned, h signed), for the sixteen-token tile on AVX-512
// (group16_x16): sum_j w_j q_j = 256 (sum_j w_j (h_j + 128) - 128 sum_j w_j) + sum_j w_j l_j, the same exact int32,
// from vpdpbusd on the rows' int8 codes, so the codes stay 8 vectors and sixteen tokens' sums fit in registers.
struct BlockX16 {
  int16_t q[kBlock];  // for i = 0..7: x[4i], x[4i + 2], x[4i + 1], x[4i + 3] (rounded)
  float d;            // the step
  uint32_t l[8];      // dword i: the low bytes of x[4i], x[4i + 1], x[4i + 2], x[4i + 3] (rounded)
  uint32_t h[8];      // dword i: their high bytes + 128
};

// Fill o.l / o.h from o.q.
inline void split16(BlockX16& o) {
  for (int i = 0; i < 8; ++i) {
    const int16_t v[4] = {o.q[4 * i], o.q[4 * i + 2], o.q[4 * i + 1], o.q[4 * i + 3]};
    uint32_t l = 0, h = 0;
    for (int k = 0; k < 4; ++k) {
      l |= static_cast<uint32_t>(static_cast<uint8_t>(v[k] & 0xFF)) << (8 * k);
      h |= static_cast<uint32_t>(static_cast<uint8_t>((v[k] >> 8) + 128)) << (8 * k);
    }
    o.l[i] = l;
    o.h[i] = h;
  }
}

// One token: x [K] -> xq [K / 32]. A block holding NaN or Inf gets d = NaN.
inline void quantize16(const float* x, int64_t nb, BlockX16* xq) {
  for (int64_t b = 0; b < nb; ++b) {
    const localmoe::Block32 blk = localmoe::load_block32(x + b * kBlock);
    BlockX16& o = xq[b];
    if (!blk.finite || blk.top == 0.0f) {
      o.d = blk.finite ? 0.0f : std::nanf("");
      std::memset(o.q, 0, sizeof(o.q));
      split16(o);
      continue;
    }
    const __m256 inv = _mm256_set1_ps(32767.0f / blk.top);
    for (int j = 0; j < 4; ++j) {  // values 8j .. 8j + 7: pairs of groups i = 2j, 2j + 1
      alignas(32) int32_t q[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), localmoe::round_scaled(blk.v[j], inv));
      for (int k = 0; k < 2; ++k) {
        int16_t* out = o.q + 8 * j + 4 * k;
        out[0] = static_cast<int16_t>(q[4 * k]);
        out[1] = static_cast<int16_t>(q[4 * k + 2]);
        out[2] = static_cast<int16_t>(q[4 * k + 1]);
        out[3] = static_cast<int16_t>(q[4 * k + 3]);
      }
    }
    o.d = blk.top / 32767.0f;
    split16(o);
  }
}

inline int32_t pair_x16(const BlockX16& x, int j) {  // x's int16 pair j (0..15) as a dword
  int32_t v;
  std::memcpy(&v, x.q + 2 * j, 4);
  return v;
}

// Eight rows' Q8_0 codes (Block8.codes) as int16 pairs: pairs[2i] lane r = row r's codes (4i, 4i + 2),
// pairs[2i + 1] = (4i + 1, 4i + 3), each sign-extended.
__attribute__((always_inline)) inline void q8_0_pairs8(const uint8_t* blk, int64_t stride, __m256i pairs[16]) {
  __m256i codes[8];
  q8_0_codes8(blk, stride, codes);
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm256_srai_epi16(_mm256_slli_epi16(codes[i], 8), 8);
    pairs[2 * i + 1] = _mm256_srai_epi16(codes[i], 8);
  }
}

// Rows r .. r + 7 against TN tokens of int16 x into y[t * ldy + r ..] (+ bias).
template <int TN>
inline void group8_x16(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX16* const* x, float* y,
                       int64_t ldy, const float* bias) {
  constexpr int kChains = TN == 1 ? 4 : 2;  // integer sums: exact in any order
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  const NextGroup ahead(row0, 8, stride, nb);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    __m256i pairs[16];
    q8_0_pairs8(row0 + b * 34, stride, pairs);
    const __m256 d = halves8(gather8(row0 + b * 34, stride), false);
#pragma GCC unroll 8
    for (int t = 0; t < TN; ++t) {
      const BlockX16& xb = x[t][b];
      __m256i s[kChains];
      for (int c = 0; c < kChains; ++c) s[c] = _mm256_setzero_si256();
      for (int j = 0; j < 16; ++j) s[j % kChains] = madd_add(s[j % kChains], pairs[j], _mm256_set1_epi32(pair_x16(xb, j)));
      for (int c = 1; c < kChains; ++c) s[0] = _mm256_add_epi32(s[0], s[c]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t)
    _mm256_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm256_add_ps(acc[t], _mm256_loadu_ps(bias)));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Rows r .. r + 15 against TN tokens, group8_x16's operations for two groups of eight in one 512-bit vector per pair.
// One block of sixteen rows (`pairs`: the codes as int16 pairs, pairs[j] lane r row r's pair j; `d`: the rows'
// steps) against TN tokens' x as int16 pairs (vpdpwssd, 4 chains for one token, 2 for more), added to acc: the pairs
// form's int32 per (row, token, block) and its fp32 step, shared by the file's and the repacked layout (group16_x16,
// group16_x16r_pairs).
template <int TN>
__attribute__((always_inline)) inline void x16_pairs_block(const __m512i* pairs, __m512 d, const BlockX16* const* x,
                                                           int64_t b, __m512* acc) {
  constexpr int kChains = TN == 1 ? 4 : 2;
#pragma GCC unroll 8
  for (int t = 0; t < TN; ++t) {
    const BlockX16& xb = x[t][b];
    __m512i s[kChains];
    for (int c = 0; c < kChains; ++c) s[c] = _mm512_setzero_si512();
    for (int j = 0; j < 16; ++j)
      s[j % kChains] = _mm512_dpwssd_epi32(s[j % kChains], pairs[j], _mm512_set1_epi32(pair_x16(xb, j)));
    for (int c = 1; c < kChains; ++c) s[0] = _mm512_add_epi32(s[0], s[c]);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
  }
}

template <int TN>
inline void group16_x16(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX16* const* x, float* y,
                        int64_t ldy, const float* bias) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(row0, 16, stride, nb);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    const uint8_t* blk = row0 + b * 34;
    __m256i lo[8], hi[8];
    q8_0_codes8(blk, stride, lo);
    q8_0_codes8(blk + 8 * stride, stride, hi);
    __m512i pairs[16];
    for (int i = 0; i < 8; ++i) {
      const __m512i codes = join8(lo[i], hi[i]);
      pairs[2 * i] = _mm512_srai_epi16(_mm512_slli_epi16(codes, 8), 8);
      pairs[2 * i + 1] = _mm512_srai_epi16(codes, 8);
    }
    const __m512 d = join8(halves8(gather8(blk, stride), false), halves8(gather8(blk + 8 * stride, stride), false));
    x16_pairs_block<TN>(pairs, d, x, b, acc);
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}

// One block of sixteen rows (`codes`: lane r holds row r's codes 4i .. 4i + 3 in codes[i]; `sw`: 128 x each row's
// sum of codes; `d`: the rows' steps) against TN tokens' x bytes (BlockX16 l / h, vpdpbusd on the int8 codes), added
// to acc: the split form's int32 per (row, token, block) and its fp32 step, shared by the file's and the repacked
// layout (group16_x16_split, group16_x16r).
template <int TN>
__attribute__((always_inline)) inline void x16_split_block(const __m512i* codes, __m512i sw, __m512 d,
                                                           const BlockX16* const* x, int64_t b, __m512* acc) {
#pragma GCC unroll 16
  for (int t = 0; t < TN; ++t) {
    const BlockX16& xb = x[t][b];
    __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      sl = _mm512_dpbusd_epi32(sl, _mm512_set1_epi32(static_cast<int>(xb.l[i])), codes[i]);
      sh = _mm512_dpbusd_epi32(sh, _mm512_set1_epi32(static_cast<int>(xb.h[i])), codes[i]);
    }
    const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(sh, sw), 8), sl);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
  }
}

// Rows r .. r + 15 against 9 to 16 tokens: group16_x16's sums from x's bytes (BlockX16 l / h, vpdpbusd on the int8
// codes), the same int32 per (row, token, block) and the same fp32 chain after it, so the same bits; the codes are
// joined once per block for all the tile's tokens (benchmarks/ggml_x16_split.cpp: 0.86x the head's time at 16 tokens).
template <int TN>
inline void group16_x16_split(const uint8_t* row0, int64_t stride, int64_t nb, const BlockX16* const* x, float* y,
                              int64_t ldy, const float* bias) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(row0, 16, stride, nb);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    const uint8_t* blk = row0 + b * 34;
    __m256i lo[8], hi[8];
    q8_0_codes8(blk, stride, lo);
    q8_0_codes8(blk + 8 * stride, stride, hi);
    __m512i codes[8];
    __m512i sw = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      codes[i] = join8(lo[i], hi[i]);
      sw = _mm512_dpbusd_epi32(sw, ones, codes[i]);  // each row's sum of codes
    }
    sw = _mm512_slli_epi32(sw, 7);  // 128 sum(w): what h + 128 adds
    const __m512 d = join8(halves8(gather8(blk, stride), false), halves8(gather8(blk + 8 * stride, stride), false));
    x16_split_block<TN>(codes, sw, d, x, b, acc);
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}
#endif

// One row against one token: the value group8_x16 gives that (row, token), computed alone.
inline float rows8_x16_single(const uint8_t* row, int64_t nb, const BlockX16* x) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 34 * b;
    const BlockX16& xb = x[b];
    int32_t dot = 0;
    for (int i = 0; i < 8; ++i) {
      const int8_t* w = reinterpret_cast<const int8_t*>(blk + 2 + 4 * i);
      const int16_t* q = xb.q + 4 * i;
      dot += w[0] * q[0] + w[2] * q[1] + w[1] * q[2] + w[3] * q[3];
    }
    acc = std::fma(static_cast<float>(dot), half(blk) * xb.d, acc);
  }
  return acc;
}

// x16 rows as a group kernel for rows_fixed: sixteen rows at a time on AVX-512 VNNI, eight on AVX2; tiles of 16 / 4
// tokens (AVX-512: up to 8 tokens the 16 pair vectors and the accumulators stay in registers, 9 to 16 the 8 code
// vectors and the accumulators, group16_x16_split).
struct Rows8X16 {
  using X = BlockX16;
  static constexpr int kTile = kVnni ? 16 : 4;
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nb, const BlockX16* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    int64_t r = r0;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (; r + 16 <= r1; r += 16) {
      if constexpr (TN > 8)
        group16_x16_split<TN>(w + r * stride, stride, nb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
      else
        group16_x16<TN>(w + r * stride, stride, nb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
    }
#endif
    return r;
  }
  template <int TN>
  __attribute__((always_inline)) static void group(const uint8_t* row0, int64_t stride, int64_t nb,
                                                   const BlockX16* const* x, float* y, int64_t ldy, const float* bias) {
    group8_x16<TN>(row0, stride, nb, x, y, ldy, bias);
  }
  static float single(const uint8_t* row, int64_t nb, const BlockX16* x) { return rows8_x16_single(row, nb, x); }
};

// Q8_0_R16 (kQ8_0_R16, repacked at load: repack_q80; a dense model's x16 lm_head, engine/quantized.py
// `repack_blocks`): per group of sixteen rows (the same 544 nb bytes), the blocks' codes first, block b at 512 b as
// eight 64-byte vectors (vector i, lane r: row r's codes 4i..4i+3, i.e. what q8_0_codes8 and join8 made of the GGUF
// bytes per block and call: row r's dword i at 512 b + 64 i + 4 r), then the fp16 steps, block b's sixteen at
// 512 nb + 32 b. A group's block is read with nine loads and no transposition (AVX2 and one token: each half of
// eight rows, the 32 bytes at + 32 h); the same values as the GGUF layout, the same operations after the load,
// hence the same bits on every path.
constexpr int64_t kQ80R16Rows = 16;
inline void repack_q80(const uint8_t* src, uint8_t* dst, int64_t O, int64_t nb, bool pack, uint8_t* tmp) {
  const int64_t group = kQ80R16Rows * nb * 34;
  for (int64_t g = 0; g < O / kQ80R16Rows; ++g) {
    std::memcpy(tmp, src + g * group, group);
    uint8_t* plain_base = pack ? tmp : dst + g * group;
    uint8_t* packed = pack ? dst + g * group : tmp;
    for (int r = 0; r < kQ80R16Rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* plain = plain_base + (r * nb + b) * 34;
        uint8_t* step = packed + 512 * nb + 32 * b + 2 * r;
        if (pack) std::memcpy(step, plain, 2);
        else std::memcpy(plain, step, 2);
        for (int i = 0; i < 8; ++i) {
          uint8_t* at = packed + 512 * b + 64 * i + 4 * r;
          if (pack) std::memcpy(at, plain + 2 + 4 * i, 4);
          else std::memcpy(plain + 2 + 4 * i, at, 4);
        }
      }
  }
}

// The Q8_0_R16 group at g0 against TN tokens, eight rows a vector (AVX2): group8_x16's operations on the repacked
// bytes for each half of eight rows in turn, block by block (one pass over the group's bytes).
template <int TN>
inline void group8_x16r(const uint8_t* g0, int64_t nb, const BlockX16* const* x, float* y, int64_t ldy,
                        const float* bias) {
  constexpr int kChains = TN == 1 ? 4 : 2;  // integer sums: exact in any order
  __m256 acc[2][TN];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TN; ++t) acc[h][t] = _mm256_setzero_ps();
  const NextGroup ahead(g0, kQ80R16Rows, 34 * nb, nb);
  const uint8_t* steps = g0 + 512 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    for (int h = 0; h < 2; ++h) {
      __m256i pairs[16];
      for (int i = 0; i < 8; ++i) {
        const __m256i codes = load32(g0 + 512 * b + 64 * i + 32 * h);
        pairs[2 * i] = _mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 8);
        pairs[2 * i + 1] = _mm256_srai_epi16(codes, 8);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(steps + 32 * b + 16 * h)));
#pragma GCC unroll 8
      for (int t = 0; t < TN; ++t) {
        const BlockX16& xb = x[t][b];
        __m256i s[kChains];
        for (int c = 0; c < kChains; ++c) s[c] = _mm256_setzero_si256();
        for (int j = 0; j < 16; ++j)
          s[j % kChains] = madd_add(s[j % kChains], pairs[j], _mm256_set1_epi32(pair_x16(xb, j)));
        for (int c = 1; c < kChains; ++c) s[0] = _mm256_add_epi32(s[0], s[c]);
        acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc[h][t]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TN; ++t)
      _mm256_storeu_ps(y + t * ldy + 8 * h,
                       bias == nullptr ? acc[h][t] : _mm256_add_ps(acc[h][t], _mm256_loadu_ps(bias + 8 * h)));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The sixteen rows of the Q8_0_R16 group at g0 against 2 to 16 tokens: group16_x16_split's operations on the
// repacked bytes (x's bytes l / h against the int8 codes, vpdpbusd): the same int32 per (row, token, block) as the
// int16 pairs, the same fp32 chain after it, so the same bits.
template <int TN>
inline void group16_x16r(const uint8_t* g0, int64_t nb, const BlockX16* const* x, float* y, int64_t ldy,
                         const float* bias) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(g0, kQ80R16Rows, 34 * nb, nb);
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* steps = g0 + 512 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    __m512i codes[8];
    __m512i sw = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      codes[i] = _mm512_loadu_si512(g0 + 512 * b + 64 * i);
      sw = _mm512_dpbusd_epi32(sw, ones, codes[i]);  // each row's sum of codes
    }
    sw = _mm512_slli_epi32(sw, 7);  // 128 sum(w): what h + 128 adds
    const __m512 d = _mm512_cvtph_ps(load32(steps + 32 * b));
    x16_split_block<TN>(codes, sw, d, x, b, acc);
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The sixteen rows of the Q8_0_R16 group at g0 against TN tokens: group16_x16's operations (int16 pairs, vpdpwssd)
// on the repacked bytes.
template <int TN>
inline void group16_x16r_pairs(const uint8_t* g0, int64_t nb, const BlockX16* const* x, float* y, int64_t ldy,
                               const float* bias) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  const NextGroup ahead(g0, kQ80R16Rows, 34 * nb, nb);
  const uint8_t* steps = g0 + 512 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    ahead.fetch(b);
    __m512i pairs[16];
    for (int i = 0; i < 8; ++i) {
      const __m512i codes = _mm512_loadu_si512(g0 + 512 * b + 64 * i);
      pairs[2 * i] = _mm512_srai_epi16(_mm512_slli_epi16(codes, 8), 8);
      pairs[2 * i + 1] = _mm512_srai_epi16(codes, 8);
    }
    const __m512 d = _mm512_cvtph_ps(load32(steps + 32 * b));
    x16_pairs_block<TN>(pairs, d, x, b, acc);
  }
  for (int t = 0; t < TN; ++t)
    _mm512_storeu_ps(y + t * ldy, bias == nullptr ? acc[t] : _mm512_add_ps(acc[t], _mm512_loadu_ps(bias)));
}
#endif

// The Q8_0_R16 group at g0 (all sixteen rows) against TN tokens into y[t * ldy + 0..16) (+ bias): on AVX-512 VNNI one
// token through the int16 pairs (group16_x16r_pairs), 2 to 16 through x's bytes (group16_x16r: the split form's
// per-block work is 8 vpdpbusd where the pairs' is 24 shifts; C harness, 49152 x 576, 3 to 5 tokens 1.57-1.66 against
// 1.75-1.86 cycles per (row, block, token)); AVX2 group8_x16r.
template <int TN>
inline void group_x16r(const uint8_t* g0, int64_t nb, const BlockX16* const* x, float* y, int64_t ldy,
                       const float* bias) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (TN > 1) return group16_x16r<TN>(g0, nb, x, y, ldy, bias);
  else return group16_x16r_pairs<TN>(g0, nb, x, y, ldy, bias);
#else
  group8_x16r<TN>(g0, nb, x, y, ldy, bias);
#endif
}

// Q8_0_R16 as a group kernel for rows_fixed: `wide` takes every row of the range, a group of sixteen at a time; a
// group the range cuts is computed whole into a buffer and the range's rows copied out (as Rows8R8).
struct Rows16X16 {
  using X = BlockX16;
  static constexpr int kTile = kVnni ? 16 : 4;
  template <int TN>
  static int64_t wide(const uint8_t* w, int64_t stride, int64_t nb, const BlockX16* const* x, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, const float* bias) {
    for (int64_t r = r0; r < r1;) {
      const int64_t g = r / kQ80R16Rows * kQ80R16Rows;
      if (g == r && r + kQ80R16Rows <= r1) {
        group_x16r<TN>(w + r * stride, nb, x, y + r, ldy, bias == nullptr ? nullptr : bias + r);
        r += kQ80R16Rows;
        continue;
      }
      float part[kQ80R16Rows * TN];
      group_x16r<TN>(w + g * stride, nb, x, part, kQ80R16Rows, nullptr);
      for (const int64_t end = std::min(r1, g + kQ80R16Rows); r < end; ++r)
        for (int t = 0; t < TN; ++t)
          y[t * ldy + r] = bias == nullptr ? part[kQ80R16Rows * t + r - g] : part[kQ80R16Rows * t + r - g] + bias[r];
    }
    return r1;
  }
  template <int TN>
  static void group(const uint8_t*, int64_t, int64_t, const BlockX16* const*, float*, int64_t, const float*) {}  // never: wide takes all
  static float single(const uint8_t*, int64_t, const BlockX16*) { return std::nanf(""); }  // never: wide takes all
};

// Whether a type has a fp32-x row (exact_x).
inline bool has_exact_x(int type) { return type == kQ8_0 || type == kQ4_K || type == kQ6_K; }

// One weight row against TN tokens of fp32 x: out[t] = row . x[t].
template <class U, int TN>
inline void dot_tokens(const uint8_t* row, int64_t units, const float* const* x, float* out) {
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) U::template unit<TN>(row + u * U::kBytes, x, u, acc);
  for (int t = 0; t < TN; ++t) out[t] = hsum(acc[t]);
}

// dot_tokens for a run-time n <= TN.
template <class U, int TN>
inline void dot_n(int n, const uint8_t* row, int64_t units, const float* const* x, float* out) {
  if constexpr (TN > 1)
    if (n < TN) return dot_n<U, TN - 1>(n, row, units, x, out);
  dot_tokens<U, TN>(row, units, x, out);
}

// Bytes of scratch `gemv` needs for N tokens of K (int8 x: XQ, either form).
inline int64_t scratch_bytes(int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, padded = (N + 7) / 8 * 8;
  // + 8 floats: a tile of 4 (AVX2) at the end of the last row still loads 8
  const int64_t per32 = N * nb * static_cast<int64_t>(sizeof(BlockX)) + (nb * padded + 8) * static_cast<int64_t>(sizeof(float));
  return std::max({per32, N * (K / kSuper) * static_cast<int64_t>(sizeof(BlockXK)),
                   N * nb * static_cast<int64_t>(sizeof(BlockX16))});
}

// x [N, K] rounded to int16 per 32 into `scratch` (scratch_bytes(N, K)), as the x16 rows read it.
inline XQ round_x16(const float* x, int64_t N, int64_t K, void* scratch) {
  const int64_t nb = K / kBlock;
  BlockX16* blocks = static_cast<BlockX16*>(scratch);
  for (int64_t t = 0; t < N; ++t) quantize16(x + t * K, nb, blocks + t * nb);
  return XQ{nullptr, nullptr, nb, (N + 7) / 8 * 8, nullptr, blocks};
}

// x [N, K] rounded into `scratch` (scratch_bytes(N, K)) as the int8 rows of a K-quant (per 256, `k_quant`) or
// of another type (per 32) read it.
inline XQ round_x(const float* x, int64_t N, int64_t K, bool k_quant, void* scratch) {
  const int64_t nb = K / kBlock;
  if (k_quant) {
    BlockXK* blocks = static_cast<BlockXK*>(scratch);
    for (int64_t t = 0; t < N; ++t) quantize_k(x + t * K, K / kSuper, blocks + t * (K / kSuper));
    return XQ{nullptr, nullptr, nb, (N + 7) / 8 * 8, blocks};
  }
  BlockX* blocks = static_cast<BlockX*>(scratch);
  float* s = reinterpret_cast<float*>(blocks + N * nb);
  const XQ xq{blocks, s, nb, (N + 7) / 8 * 8, nullptr};
  std::memset(s, 0, nb * xq.padded * sizeof(float));
  for (int64_t t = 0; t < N; ++t) {
    quantize(x + t * K, nb, blocks + t * nb);
    for (int64_t b = 0; b < nb; ++b) s[b * xq.padded + t] = blocks[t * nb + b].s;
  }
  return xq;
}

// Token t of a tile, from token `first` of xq on.
inline void tile_token(Tile& x, const XQ& xq, int t, int64_t first) {
  if (xq.kblocks) x.k[t] = xq.kblocks + first * (xq.nb / 8);
  else x.x[t] = xq.blocks + first * xq.nb;
}

struct Args {
  XQ xq;
  const float* x;  // fp32 rows (exact_x)
  int64_t N, K;
  const uint8_t* w;
  int64_t row_bytes, O;
  const float* bias;
  float* y;
  int64_t ldy;  // floats between tokens' rows of y (O, or more where y is a slice of wider rows)
};

template <class U, int TN>
inline void dot_n_int8(int n, const uint8_t* row, int64_t units, const Tile& x, float* out) {
  if constexpr (TN > 1)
    if (n < TN) return dot_n_int8<U, TN - 1>(n, row, units, x, out);
  dot_tokens_int8<U, TN>(row, units, x, out);
}

// Rows o0..o1 of W against all N tokens of int8 x, kTile tokens at a time.
template <class U>
inline void rows_int8(const void* ctx, int64_t o0, int64_t o1) {
  const Args& a = *static_cast<const Args*>(ctx);
  const int64_t units = a.row_bytes / U::kBytes;
  Tile x{};
  x.padded = a.xq.padded;
  if (a.N == 1 && a.bias == nullptr) {
    tile_token(x, a.xq, 0, 0);
    x.s = a.xq.s;
    return rows_one_token<U>(a.w, a.row_bytes, units, x, o0, o1, a.y);
  }
  float v[kTile];
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = a.w + o * a.row_bytes;
    for (int64_t t0 = 0; t0 < a.N; t0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, a.N - t0));
      for (int t = 0; t < n; ++t) tile_token(x, a.xq, t, t0 + t);
      x.s = a.xq.s ? a.xq.s + t0 : nullptr;
      dot_n_int8<U, kTile>(n, row, units, x, v);
      for (int t = 0; t < n; ++t) a.y[(t0 + t) * a.ldy + o] = a.bias == nullptr ? v[t] : v[t] + a.bias[o];
    }
  }
}

// Token t's x as a group kernel reads it (G::X).
inline const BlockX* token_x(const Args& a, int64_t t, const BlockX*) { return a.xq.blocks + t * a.xq.nb; }
inline const BlockXK* token_x(const Args& a, int64_t t, const BlockXK*) { return a.xq.kblocks + t * (a.xq.nb / 8); }
inline const float* token_x(const Args& a, int64_t t, const float*) { return a.x + t * a.K; }
inline const BlockX16* token_x(const Args& a, int64_t t, const BlockX16*) { return a.xq.blocks16 + t * a.xq.nb; }

// Rows o0..o1 of W against all N tokens through group kernel G (rows8<T>: Rows8<T>, Q4_K: Rows8K, Q8_0 on fp32 x:
// Rows8F32, on int16 x: Rows8X16), G::kTile tokens at a time.
template <class G>
inline void rows_grouped(const void* ctx, int64_t o0, int64_t o1) {
  const Args& a = *static_cast<const Args*>(ctx);
  using X = typename G::X;
  const int64_t units = std::is_same_v<X, BlockXK> ? a.xq.nb / 8 : a.K / kBlock;
  const X* x[G::kTile];
  for (int64_t t0 = 0; t0 < a.N; t0 += G::kTile) {
    const int n = static_cast<int>(std::min<int64_t>(G::kTile, a.N - t0));
    for (int t = 0; t < n; ++t) x[t] = token_x(a, t0 + t, static_cast<const X*>(nullptr));
    rows_tokens<G>(a.w, a.row_bytes, units, x, n, o0, o1, a.y + t0 * a.ldy, a.ldy, a.bias);
  }
}

// Rows o0..o1 of W against all N tokens of fp32 x, kTile tokens at a time.
template <class U>
inline void rows_f32(const void* ctx, int64_t o0, int64_t o1) {
  const Args& a = *static_cast<const Args*>(ctx);
  const int64_t units = a.row_bytes / U::kBytes;
  const float* x[kTile];
  float v[kTile];
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = a.w + o * a.row_bytes;
    for (int64_t t0 = 0; t0 < a.N; t0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, a.N - t0));
      for (int t = 0; t < n; ++t) x[t] = a.x + (t0 + t) * a.K;
      dot_n<U, kTile>(n, row, units, x, v);
      for (int t = 0; t < n; ++t) a.y[(t0 + t) * a.ldy + o] = a.bias == nullptr ? v[t] : v[t] + a.bias[o];
    }
  }
}

// What x is read as: rounded to int8 per block (per 32, per 256 for the K-quants), fp32 as it is (exact_x: Q8_0, Q4_K,
// Q6_K, has_exact_x), or rounded to int16 per 32 (Q8_0: x16 above).
enum XMode : int { kXInt8 = 0, kXF32 = 1, kXInt16 = 2 };

inline bool has_x_mode(int type, int mode) {
  if (type == kQ8_0_R16) return mode == kXInt16;  // read by the x16 rows only
  return mode == kXInt8 || (mode == kXF32 && has_exact_x(type)) || (mode == kXInt16 && type == kQ8_0);
}

// x [N, K] as a matrix of `type` reads it under `x_mode` (has_x_mode), rounded into `scratch` (scratch_bytes(N, K)):
// int8 per 32 values, per 256 for the K-quants (round_x), int16 per 32 (round_x16); fp32 x (kXF32) is read as it is
// (an empty XQ). Two types with the same `rounding` read the same XQ.
inline XQ round_for(const float* x, int64_t N, int64_t K, int type, void* scratch, int x_mode = kXInt8) {
  return x_mode == kXF32 ? XQ{} : x_mode == kXInt16 ? round_x16(x, N, K, scratch)
                                                    : round_x(x, N, K, is_k_quant(type), scratch);
}
inline int rounding(int type, int x_mode) { return x_mode == kXInt8 && is_k_quant(type) ? 3 : x_mode; }

// y [N, O] (row t at y + t * ldy) = x [N, K] W^T (+ bias) for x already rounded by round_for(x, N, K, type, .., x_mode)
// (or one of the same `rounding`): rows on the pool.
inline void gemv_rounded(const XQ& xq, const float* x, int64_t N, int64_t K, const uint8_t* w, int type, int64_t O,
                         const float* bias, float* y, int64_t ldy, int threads, int x_mode = kXInt8) {
  const int64_t nb = K / kBlock;
  const bool exact_x = x_mode == kXF32;
  const int64_t bytes = row_bytes(type, nb);
  const Args args{xq, x, N, K, w, bytes, O, bias, y, ldy};
  void (*fn)(const void*, int64_t, int64_t);
  if (exact_x)
    fn = type == kQ4_K ? rows_f32<Q4KF32> : type == kQ6_K ? rows_f32<Q6KF32> : rows_grouped<Rows8F32>;
  else if (x_mode == kXInt16)
    fn = type == kQ8_0_R16 ? rows_grouped<Rows16X16> : rows_grouped<Rows8X16>;
  else
    fn = type == kQ4_0   ? rows_grouped<Rows8<kQ4_0>>
         : type == kQ4_1 ? rows_grouped<Rows8<kQ4_1>>
         : type == kQ4_1_R8 ? rows_grouped<Rows8R8<kQ4_1>>
         : type == kQ5_0 ? rows_grouped<Rows8<kQ5_0>>
         : type == kQ5_1 ? rows_grouped<Rows8<kQ5_1>>
         : type == kQ4_K ? rows_grouped<Rows8K>
         : type == kQ4_K_R8 ? rows_grouped<Rows8KR8>
         : type == kQ5_K ? rows_grouped<Rows8K5>
         : type == kQ6_K ? rows_grouped<Rows8K6>
         : type == kQ6_K_R8 ? rows_grouped<Rows8K6R8>
         : type == kIQ4_NL ? rows_grouped<RowsIQ4<kIQ4_NL>>
         : type == kIQ4_XS ? rows_grouped<RowsIQ4<kIQ4_XS>>
                         : rows_grouped<Rows8<kQ8_0>>;
  int64_t chunk = localmoe::kChunkBytes / std::max<int64_t>(1, bytes * N);
  if (has_rows8(type)) chunk = (chunk + 15) / 16 * 16;  // whole groups of sixteen rows (Q8_0 on fp32 / int16 x too)
  localmoe::parallel(fn, &args, O, chunk, threads);
}

// y [N, O] = x [N, K] W^T (+ bias): x rounded into `scratch` as `x_mode` says (round_for), then the rows (gemv_rounded).
inline void gemv(const float* x, int64_t N, int64_t K, const uint8_t* w, int type, int64_t O, const float* bias,
                 float* y, void* scratch, int threads, int x_mode = kXInt8) {
  gemv_rounded(round_for(x, N, K, type, scratch, x_mode), x, N, K, w, type, O, bias, y, O, threads, x_mode);
}

}  // namespace localmoe_ggml
