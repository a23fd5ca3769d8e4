// Vectorised fp32 math (AVX2 + FMA) shared by the CPU kernels: the horizontal sum of 8 lanes, and
// e^x, sigmoid, tanh 8 lanes at a time.
// Cephes-style polynomials (~1-2 ulp); the same instructions for every lane, so a value's result
// does not depend on where it sits in a buffer.
#pragma once

#include <immintrin.h>

namespace localmoe {

// The sum of v's 8 lanes (pairwise, always in the same order).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of eight vectors v[0..8) at once, with hsum's additions (lo + hi halves, then lanes 0 + 2 and 1 + 3, then
// those two; a + b == b + a exactly), so the same bits in ~2.6 instead of 6 shuffles and adds a sum.
// In two steps: r[i] = hsum_halves(v[2i], v[2i + 1]) as pairs come, then hsum_finish(r) = [hsum(v[0]), ..., hsum(v[7])].
inline __m256 hsum_halves(__m256 a, __m256 b) {  // [lo + hi of a | of b]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline __m256 hsum_finish(const __m256* r) {
  // per 128-bit lane: [0 + 2, 1 + 3 of one sum, of the next but one]
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(r[0], r[1], 0x44), _mm256_shuffle_ps(r[0], r[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(r[2], r[3], 0x44), _mm256_shuffle_ps(r[2], r[3], 0xEE));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));  // [0 2 4 6 | 1 3 5 7]
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// out[i] = hsum(v[i]), i < 8.
inline void hsum8(const __m256* v, float* out) {
  __m256 r[4];
  for (int i = 0; i < 4; ++i) r[i] = hsum_halves(v[2 * i], v[2 * i + 1]);
  _mm256_storeu_ps(out, hsum_finish(r));
}

// The largest of v's 8 lanes.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x in fp32 range (clamped to +-88.376; results below 2^-126 flush to 0).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: x - n ln2, nearly exact
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scale = _mm256_and_ps(_mm256_castsi256_ps(e),  // 2^n; 0 where n + 127 <= 0
                                     _mm256_cmp_ps(n, _mm256_set1_ps(-127.0f), _CMP_GT_OQ));
  return _mm256_mul_ps(p, scale);
}

inline __m256 sigmoid_ps(__m256 x) {  // 1 / (1 + e^-x)
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline __m256 tanh_ps(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  // |x| >= 0.625: 1 - 2 / (e^2|x| + 1); below, an odd polynomial (no cancellation near 0)
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                      _mm256_add_ps(exp_ps(_mm256_add_ps(a, a)), one)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 large = _mm256_or_ps(big, _mm256_and_ps(sign, x));
  return _mm256_blendv_ps(small, large, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_GE_OQ));
}

// 32 consecutive floats (one quantisation block of activations) in four vectors, with their largest
// magnitude and whether all of them are finite: what each activation quantiser starts from.
struct Block32 {
  __m256 v[4];
  float top;
  bool finite;
};

inline Block32 load_block32(const float* x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  Block32 b;
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    b.v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_and_ps(b.v[j], abs_mask));
    bad = _mm256_or_ps(bad, _mm256_mul_ps(b.v[j], _mm256_setzero_ps()));  // NaN where x is NaN or Inf
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  b.top = _mm_cvtss_f32(m);
  b.finite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) == 0;
  return b;
}

// round(v * inv) to nearest even, as int32 (the int8 activation codes before narrowing).
inline __m256i round_scaled(__m256 v, __m256 inv) {
  return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace localmoe
