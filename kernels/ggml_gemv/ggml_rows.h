// GGUF block GEMV rows (AVX2 + FMA + F16C) shared by `ggml_gemv` (ggml_cpu.cpp) and the decode
// steps that read GGUF weights (kernels/_cpu/matrix.h); what and why: ggml_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pool.h"
#include "vec_math.h"

namespace localmoe_ggml {

using localmoe::hsum;

constexpr int64_t kBlock = 32;
// GGMLQuantizationType values
enum Type : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

inline bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Bytes of one row of `nb` blocks of 32 values (K-quants: nb a multiple of 8, super-blocks of 256).
inline int64_t row_bytes(int type, int64_t nb) {
  switch (type) {
    case kQ4_0: return nb * 18;
    case kQ4_1: return nb * 20;
    case kQ5_0: return nb * 22;
    case kQ5_1: return nb * 24;
    case kQ8_0: return nb * 34;
    case kQ4_K: return nb / 8 * 144;
    case kQ5_K: return nb / 8 * 176;
    case kQ6_K: return nb / 8 * 210;
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
    int32_t sum = 0;
    for (int j = 0; j < 4; ++j) {
      alignas(32) int32_t q[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), localmoe::round_scaled(blk.v[j], inv));
      for (int i = 0; i < 8; ++i) {
        o.q[8 * j + i] = static_cast<int8_t>(q[i]);
        sum += q[i];
      }
    }
    o.d = top / 127.0f;
    o.s = o.d * static_cast<float>(sum);
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

template <int T>
inline float row_dot(const uint8_t* row, int64_t nb, const BlockX* x) {
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : 34;
  constexpr int64_t codes = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;  // offset of the nibbles
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  float corr = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = half(blk);
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].q));
    __m256i p;
    if (T == kQ8_0) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes));
      const __m128i lo = _mm_set1_epi8(0x0F);
      __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
      if (T == kQ5_0 || T == kQ5_1) w = _mm256_or_si256(w, fifth_bits(blk + codes - 4));
      p = _mm256_maddubs_epi16(w, xq);  // |pair| <= 2 * 31 * 127
      corr += T == kQ4_0   ? -8.0f * d * x[b].s
              : T == kQ5_0 ? -16.0f * d * x[b].s
                           : half(blk + 2) * x[b].s;  // Q4_1, Q5_1: + m sum(x)
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(d * x[b].d), acc);
  }
  return hsum(acc) + corr;
}

// Q4_K: super-blocks of 256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles; sub-block j (32 values) is d sc[j] q - dmin m[j], and bytes 32p..32p+31 hold
// sub-block 2p in their low nibbles, 2p + 1 in their high ones. One 32-byte load feeds two of x's
// int8 blocks; the mins come in through d * sum(q) of x, as Q4_1's m.
inline void q4_k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {  // 0-3: low 6 bits of bytes 0-3 / 4-7; 4-7: bytes 8-11, top bits of 0-7
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// Q5_K: Q4_K with a fifth bit per value, 176 bytes: d, dmin, the same 12 scale bytes, qh[32] (bit j of
// qh[i]: value i of sub-block j), then Q4_K's 128 bytes of nibbles. One row function serves both.
template <bool kFifthBit>
inline float row_dot_q45_k(const uint8_t* row, int64_t nb, const BlockX* x) {
  constexpr int64_t bytes = kFifthBit ? 176 : 144, nibbles = kFifthBit ? 48 : 16;
  const __m256i ones = _mm256_set1_epi16(1), one = _mm256_set1_epi8(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  float corr = 0.0f;
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * bytes;
    const float d = half(blk), dmin = half(blk + 2);
    uint8_t sc[8], mn[8];
    q4_k_scales(blk + 4, sc, mn);
    const __m256i qh = kFifthBit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : one;
    const BlockX* xb = x + sb * 8;
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + nibbles + 32 * p));
      const __m256i w[2] = {_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        __m256i wj = w[h];
        if (kFifthBit) {
          const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
          wj = _mm256_or_si256(wj, _mm256_slli_epi16(bit, 4));
        }
        const BlockX& xj = xb[j];
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj.q));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wj, xq), ones);  // |pair| <= 2 * 31 * 127
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * sc[j] * xj.d), acc);
        corr += dmin * mn[j] * xj.s;
      }
    }
  }
  return hsum(acc) - corr;
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

// q - 32 is signed: |q - 32| against x with q's sign (as Q8_0), and the two 16-value halves of x's
// block get their scales in one vpmaddwd.
inline float row_dot_q6_k(const uint8_t* row, int64_t nb, const BlockX* x) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half(blk + 208);
    const BlockX* xb = x + sb * 8;
    for (int c = 0; c < 8; ++c) {
      const __m256i q = q6_k_codes(blk, c);
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[c].q));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q));  // <= 8128
      const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(scales[2 * c + 1]), _mm_set1_epi16(scales[2 * c]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale)), _mm256_set1_ps(d * xb[c].d), acc);
    }
  }
  return hsum(acc);
}

// Q8_0 row against fp32 x (no rounding of x): each block's int8 weights widened to fp32 in registers.
// ~18 operations per 34 bytes against ~9 on the int8 path, still past one core's memory stream; for
// the lm_head, whose logits pick the token (engine/transformer.py).
inline float row_dot_q8_0_f32(const uint8_t* row, int64_t nb, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const float* xb = x + b * kBlock;
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(xb + 16), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), s);
    acc = _mm256_fmadd_ps(s, _mm256_set1_ps(half(blk)), acc);
  }
  return hsum(acc);
}

// Q4_K / Q6_K rows against fp32 x (exact_x, for the lm_head): codes widened to fp32 in registers, 8 at a
// time, against x; Q4_K's mins come in through each sub-block's sum of x.
inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline __m256 widen_s8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

inline float row_dot_q4_k_f32(const uint8_t* row, int64_t nb, const float* x) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * 144;
    const float d = half(blk), dmin = half(blk + 2);
    uint8_t sc[8], mn[8];
    q4_k_scales(blk + 4, sc, mn);
    const float* xs = x + sb * 256;
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p));
      const __m256i w[2] = {_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        const float* xj = xs + 32 * j;
        const __m128i lo = _mm256_castsi256_si128(w[h]), hi = _mm256_extracti128_si256(w[h], 1);
        const __m256 x0 = _mm256_loadu_ps(xj), x1 = _mm256_loadu_ps(xj + 8);
        const __m256 x2 = _mm256_loadu_ps(xj + 16), x3 = _mm256_loadu_ps(xj + 24);
        __m256 qx = _mm256_mul_ps(widen_u8(lo), x0);
        qx = _mm256_fmadd_ps(widen_u8(_mm_srli_si128(lo, 8)), x1, qx);
        qx = _mm256_fmadd_ps(widen_u8(hi), x2, qx);
        qx = _mm256_fmadd_ps(widen_u8(_mm_srli_si128(hi, 8)), x3, qx);
        const __m256 sum_x = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
        acc = _mm256_fmadd_ps(qx, _mm256_set1_ps(d * sc[j]), acc);
        acc = _mm256_fnmadd_ps(sum_x, _mm256_set1_ps(dmin * mn[j]), acc);
      }
    }
  }
  return hsum(acc);
}

inline float row_dot_q6_k_f32(const uint8_t* row, int64_t nb, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half(blk + 208);
    for (int c = 0; c < 8; ++c) {
      const __m256i q = q6_k_codes(blk, c);
      const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
      const float* xc = x + sb * 256 + 32 * c;
      __m256 first = _mm256_mul_ps(widen_s8(q0), _mm256_loadu_ps(xc));  // values 0-15: scale 2c
      first = _mm256_fmadd_ps(widen_s8(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(xc + 8), first);
      __m256 second = _mm256_mul_ps(widen_s8(q1), _mm256_loadu_ps(xc + 16));  // 16-31: scale 2c + 1
      second = _mm256_fmadd_ps(widen_s8(_mm_srli_si128(q1, 8)), _mm256_loadu_ps(xc + 24), second);
      acc = _mm256_fmadd_ps(first, _mm256_set1_ps(d * scales[2 * c]), acc);
      acc = _mm256_fmadd_ps(second, _mm256_set1_ps(d * scales[2 * c + 1]), acc);
    }
  }
  return hsum(acc);
}

// Whether a type has a fp32-x row (exact_x).
inline bool has_exact_x(int type) { return type == kQ8_0 || type == kQ4_K || type == kQ6_K; }

struct Args {
  const BlockX* xq;
  const float* x;  // fp32 rows (row_dot_q8_0_f32), or null
  int64_t N, nb;
  const uint8_t* w;
  int64_t row_bytes, O;
  const float* bias;
  float* y;
  int type;
};

template <int T>
inline void rows(const void* ctx, int64_t o0, int64_t o1) {
  const Args& a = *static_cast<const Args*>(ctx);
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t t = 0; t < a.N; ++t) {
      const uint8_t* w = a.w + o * a.row_bytes;
      const BlockX* xq = a.xq + t * a.nb;
      float v;
      if (a.x != nullptr) {
        const float* xt = a.x + t * a.nb * kBlock;
        v = T == kQ4_K ? row_dot_q4_k_f32(w, a.nb, xt)
            : T == kQ6_K ? row_dot_q6_k_f32(w, a.nb, xt)
                         : row_dot_q8_0_f32(w, a.nb, xt);
      } else if (T == kQ4_K || T == kQ5_K)
        v = row_dot_q45_k<T == kQ5_K>(w, a.nb, xq);
      else if (T == kQ6_K)
        v = row_dot_q6_k(w, a.nb, xq);
      else
        v = row_dot<T>(w, a.nb, xq);
      a.y[t * a.O + o] = a.bias == nullptr ? v : v + a.bias[o];
    }
}


// y [N, O] = x [N, K] W^T (+ bias): x quantised into xq (N * K / 32 BlockX), then rows on the pool;
// with exact_x (Q8_0, Q4_K, Q6_K: has_exact_x) x is read as it is and xq is not used.
inline void gemv(const float* x, int64_t N, int64_t K, const uint8_t* w, int type, int64_t O, const float* bias,
                 float* y, BlockX* xq, int threads, bool exact_x = false) {
  const int64_t nb = K / kBlock;
  if (!exact_x)
    for (int64_t t = 0; t < N; ++t) quantize(x + t * K, nb, xq + t * nb);
  const int64_t bytes = row_bytes(type, nb);
  const Args args{xq, exact_x ? x : nullptr, N, nb, w, bytes, O, bias, y, type};
  auto fn = type == kQ4_0   ? rows<kQ4_0>
            : type == kQ4_1 ? rows<kQ4_1>
            : type == kQ5_0 ? rows<kQ5_0>
            : type == kQ5_1 ? rows<kQ5_1>
            : type == kQ4_K ? rows<kQ4_K>
            : type == kQ5_K ? rows<kQ5_K>
            : type == kQ6_K ? rows<kQ6_K>
                            : rows<kQ8_0>;
  localmoe::parallel(fn, &args, O, localmoe::kChunkBytes / std::max<int64_t>(1, bytes * N), threads);
}

}  // namespace localmoe_ggml
