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
enum Type : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGMLQuantizationType values

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

template <int T>
inline float row_dot(const uint8_t* row, int64_t nb, const BlockX* x) {
  constexpr int64_t bytes = T == kQ4_0 ? 18 : (T == kQ4_1 ? 20 : 34);
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
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == kQ4_0 ? 2 : 4)));
      const __m128i lo = _mm_set1_epi8(0x0F);
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
      p = _mm256_maddubs_epi16(w, xq);  // |pair| <= 2 * 15 * 128
      corr += T == kQ4_0 ? -8.0f * d * x[b].s : half(blk + 2) * x[b].s;
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(d * x[b].d), acc);
  }
  return hsum(acc) + corr;
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
      const float v = a.x != nullptr ? row_dot_q8_0_f32(a.w + o * a.row_bytes, a.nb, a.x + t * a.nb * kBlock)
                                     : row_dot<T>(a.w + o * a.row_bytes, a.nb, a.xq + t * a.nb);
      a.y[t * a.O + o] = a.bias == nullptr ? v : v + a.bias[o];
    }
}


// y [N, O] = x [N, K] W^T (+ bias): x quantised into xq (N * K / 32 BlockX), then rows on the pool;
// with exact_x (Q8_0 only) x is read as it is and xq is not used.
inline void gemv(const float* x, int64_t N, int64_t K, const uint8_t* w, int type, int64_t O, const float* bias,
                 float* y, BlockX* xq, int threads, bool exact_x = false) {
  const int64_t nb = K / kBlock;
  if (!exact_x)
    for (int64_t t = 0; t < N; ++t) quantize(x + t * K, nb, xq + t * nb);
  const int64_t row_bytes = nb * (type == kQ4_0 ? 18 : (type == kQ4_1 ? 20 : 34));
  const Args args{xq, exact_x ? x : nullptr, N, nb, w, row_bytes, O, bias, y, type};
  auto fn = type == kQ4_0 ? rows<kQ4_0> : (type == kQ4_1 ? rows<kQ4_1> : rows<kQ8_0>);
  localmoe::parallel(fn, &args, O, localmoe::kChunkBytes / std::max<int64_t>(1, row_bytes * N), threads);
}

}  // namespace localmoe_ggml
