// Residual add fused with the next RMSNorm, on the CPU (AVX2 + FMA): x += delta (in place), then
// out = x / sqrt(mean(x^2) + eps) * weight, per row of D. One call per residual instead of two torch
// ops: a decode step has two per layer, each a fresh trip through torch's dispatcher with its
// code and data evicted by the weight stream. Rows are independent; each is computed whole by one
// thread (the caller's: rows are few in decode and cheap in prefill).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

extern "C" {

// x [N, D] (updated), delta [N, D] or null (plain RMSNorm), weight [D], out [N, D]; all fp32, contiguous.
void add_rms_norm(float* x, const float* delta, const float* weight, int64_t N, int64_t D, float eps, float* out) {
  for (int64_t n = 0; n < N; ++n) {
    float* xr = x + n * D;
    const float* dr = delta ? delta + n * D : nullptr;
    float* o = out + n * D;
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      __m256 v = _mm256_loadu_ps(xr + d);
      if (dr) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(dr + d));
        _mm256_storeu_ps(xr + d, v);
      }
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = localmoe::hsum(acc);
    for (; d < D; ++d) {
      if (dr) xr[d] += dr[d];
      sum += xr[d] * xr[d];
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (d = 0; d + 8 <= D; d += 8)
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), vinv), _mm256_loadu_ps(weight + d)));
    for (; d < D; ++d) o[d] = xr[d] * inv * weight[d];
  }
}

}  // extern "C"
