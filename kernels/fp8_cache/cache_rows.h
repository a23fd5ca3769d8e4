// A cache buffer of engine/cache.py (`PagedBuffer`, one sequence, identity block table) as a C++ kernel reads
// and writes it in place: fp32, bf16, or fp8 e4m3 with one fp32 scale per row of `dim` values (a token and
// head), plus, for bf16 / fp8, the exact fp32 ring of the newest positions (EXACT_RECENT).
// The written row's bits are those of the engine's write (torch's round-to-nearest-even casts; fp8:
// scale = amax / 448, or 1 for an all-zero row, then x / scale cast to e4m3 as c10 does), and a read gives
// the engine's read: the ring's row where it still holds the position among the newest `ring`, else the
// stored value widened (bf16) or q * scale in fp32 (fp8: one rounding of the exact product).
// The fp8 widening goes through F16C (an e4m3 byte shifted into an fp16 is the value times 2^-8, exactly),
// the same instructions in the AVX2 and AVX-512 builds.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace localmoe_cache {

enum : int64_t { kF32 = 0, kBF16 = 1, kFP8 = 2 };

struct CacheRows {
  int64_t dtype;        // kF32, kBF16, kFP8
  void* pool;           // [heads, capacity, dim] values of the dtype
  float* scales;        // fp8: [heads, capacity]
  float* recent;        // bf16 / fp8: [heads, ring, dim] fp32, slot = position % ring
  int64_t* recent_pos;  // [ring]: the position each slot holds (-1: none)
  int64_t heads, dim, capacity, ring;
};

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// torch's fp32 -> bf16 (c10::BFloat16: round to nearest even; NaN -> 0x7fc0)
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = bits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// torch's fp32 -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value: round to nearest even, >= 480 -> NaN)
inline uint8_t to_e4m3(float f) {
  uint32_t u = bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (1087u << 20)) {
    r = 0x7f;
  } else if (u < (121u << 23)) {  // below 2^-6: e4m3's subnormals, rounded by an fp32 add
    const uint32_t denorm = 141u << 23;
    r = static_cast<uint8_t>(bits(from_bits(u) + from_bits(denorm)) - denorm);
  } else {
    const uint32_t odd = (u >> 20) & 1u;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
    r = static_cast<uint8_t>(u >> 20);
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

// out[i] = e4m3(q[i]) * scale, one fp32 rounding each: the e4m3 byte as an fp16 (value * 2^-8, exact) times
// scale * 256 (exact), which is the exact product rounded once.
inline void e4m3_dequantize(const uint8_t* q, float scale, float* out, int64_t n) {
  const float s = scale * 256.0f;
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int64_t raw;
    std::memcpy(&raw, q + i, 8);
    const __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(raw));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
  }
  for (; i < n; ++i) {
    const uint16_t h = static_cast<uint16_t>(((q[i] & 0x80u) << 8) | ((q[i] & 0x7fu) << 7));
    out[i] = _cvtsh_ss(h) * s;
  }
}

inline void bf16_widen(const uint16_t* q, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) out[i] = from_bits(static_cast<uint32_t>(q[i]) << 16);
}

// Store q [dim] (and fp8's scale) for the fp32 row x [dim], as PagedBuffer.write does.
inline void quantize_row(int64_t dtype, const float* x, int64_t dim, void* q, float* scale) {
  if (dtype == kF32) {
    std::memcpy(q, x, dim * sizeof(float));
  } else if (dtype == kBF16) {
    uint16_t* o = static_cast<uint16_t*>(q);
    for (int64_t i = 0; i < dim; ++i) o[i] = to_bf16(x[i]);
  } else {
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint8_t* o = static_cast<uint8_t*>(q);
    for (int64_t i = 0; i < dim; ++i) o[i] = to_e4m3(x[i] / s);
    *scale = s;
  }
}

inline int64_t element_bytes(int64_t dtype) { return dtype == kF32 ? 4 : dtype == kBF16 ? 2 : 1; }

// Write the fp32 values x [heads * dim] (head h's at x + h dim) at position `pos`, as PagedBuffer.write.
inline void write(const CacheRows& c, int64_t pos, const float* x) {
  const int64_t slot = c.dtype == kF32 ? 0 : pos % c.ring;
  for (int64_t h = 0; h < c.heads; ++h) {
    const float* row = x + h * c.dim;
    const int64_t at = h * c.capacity + pos;
    quantize_row(c.dtype, row, c.dim, static_cast<char*>(c.pool) + at * c.dim * element_bytes(c.dtype),
                 c.dtype == kFP8 ? c.scales + at : nullptr);
    if (c.dtype != kF32) std::memcpy(c.recent + (h * c.ring + slot) * c.dim, row, c.dim * sizeof(float));
  }
  if (c.dtype != kF32) c.recent_pos[slot] = pos;
}

// Head h's row at position s of a cache holding `length` positions, as fp32: a pointer into the pool (fp32) or
// the exact ring, or `buf` [dim] filled with the dequantised row (PagedBuffer.read).
inline const float* row(const CacheRows& c, int64_t h, int64_t s, int64_t length, float* buf) {
  const int64_t at = h * c.capacity + s;
  if (c.dtype == kF32) return static_cast<const float*>(c.pool) + at * c.dim;
  const int64_t slot = s % c.ring;
  if (s >= length - c.ring && c.recent_pos[slot] == s) return c.recent + (h * c.ring + slot) * c.dim;
  if (c.dtype == kBF16) {
    bf16_widen(static_cast<const uint16_t*>(c.pool) + at * c.dim, buf, c.dim);
  } else {
    e4m3_dequantize(static_cast<const uint8_t*>(c.pool) + at * c.dim, c.scales[at], buf, c.dim);
  }
  return buf;
}

}  // namespace localmoe_cache
