// MXFP4 expert matmul on the CPU (AVX2 + FMA), straight from the canonical bytes.
// Plain C ABI, no torch headers, no threads: it builds in about a second with gcc and is loaded
// with ctypes (kernels/mxfp4_moe/cpu.py), whose Python threads each take a range of rows (ctypes
// releases the GIL). OpenMP was tried first: libgomp's spin-waiting made 2 threads 6x slower than
// 1 on a shared machine.
//
// y[N, O] = x[N, K] W^T, W given as packed U8 [O, K/2] (element 2i in the low nibble of byte i)
// and E8M0 scales U8 [O, K/32] (bias 127, 0xFF = NaN). Accumulation is fp32.
//
// gemv: one thread owns a weight row (results do not depend on the thread count); each
// 32-element block is decoded once — 16 bytes -> two pshufb lookups of 2 * e2m1 as int8 ->
// fp32, times the block scale / 2 — and used for up to 8 tokens at a time. x is permuted per
// block to [even elements, odd elements] so the nibbles need no interleaving.
// dequantize: the same decode, interleaved back, for the prefill path (dequantise + sgemm).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// NT tokens (x permuted, row stride K) against one weight row. Writes y[t * O] for t < NT.
// NT <= 2: the block's unscaled dot is formed first, then one FMA by its scale (a chain of one FMA
// per block, unrolled over two accumulators); NT > 2: the decoded values are scaled once and
// shared by the tokens' FMAs.
template <int NT>
inline void row_tokens(const uint8_t* prow, const uint8_t* srow, int64_t nblocks, const float* xp, int64_t K,
                       float* y, int64_t O) {
  const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
  constexpr bool kDotFirst = NT <= 2;
  constexpr int NA = kDotFirst ? 2 : (NT <= 4 ? 2 : 1);
  __m256 acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
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
        for (int j = 0; j < 4; ++j)
          acc[t][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[t][j % NA]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[t][a]);
    y[t * O] = hsum(s);
  }
}

}  // namespace

extern "C" {

// x [N, K] fp32 -> xp [N, K]: each block permuted to [x0, x2, .., x30, x1, x3, .., x31]. K % 32 == 0.
void mxfp4_permute(const float* x, int64_t n, float* xp) {
  for (int64_t i = 0; i < n; i += kBlock)
    for (int j = 0; j < 16; ++j) {
      xp[i + j] = x[i + 2 * j];
      xp[i + 16 + j] = x[i + 2 * j + 1];
    }
}

// Rows [o0, o1) of y [N, O] fp32 = xp W^T, xp from mxfp4_permute; packed [O, K/2], scales [O, K/32].
void mxfp4_gemv(const float* xp, int64_t N, int64_t K, const uint8_t* packed, const uint8_t* scales, int64_t O,
                int64_t o0, int64_t o1, float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* prow = packed + o * (K / 2);
    const uint8_t* srow = scales + o * nb;
    int64_t t = 0;
    for (; t + 8 <= N; t += 8) row_tokens<8>(prow, srow, nb, xp + t * K, K, y + t * O + o, O);
    if (N - t >= 4) { row_tokens<4>(prow, srow, nb, xp + t * K, K, y + t * O + o, O); t += 4; }
    if (N - t >= 2) { row_tokens<2>(prow, srow, nb, xp + t * K, K, y + t * O + o, O); t += 2; }
    if (N - t >= 1) row_tokens<1>(prow, srow, nb, xp + t * K, K, y + t * O + o, O);
  }
}

// Blocks [b0, b1) of packed [nblocks, 16], scales [nblocks] -> w [nblocks, 32] fp32, exact (-0 as +0).
void mxfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t b0, int64_t b1, float* w) {
  for (int64_t b = b0; b < b1; ++b) {
    const __m128i lut = code_lut(), mask = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + b * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // elements 0..15, 16..31
    const __m256 s = _mm256_set1_ps(kTables.half_scale[scales[b]]);
    float* dst = w + b * kBlock;
    _mm256_storeu_ps(dst, widen(first, s));
    _mm256_storeu_ps(dst + 8, widen(_mm_srli_si128(first, 8), s));
    _mm256_storeu_ps(dst + 16, widen(second, s));
    _mm256_storeu_ps(dst + 24, widen(_mm_srli_si128(second, 8), s));
  }
}

}  // extern "C"
