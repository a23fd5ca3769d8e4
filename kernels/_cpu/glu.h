// The gated activations of MLP and expert rows (AVX2 + FMA), shared by the fused MoE layer
// (kernels/mxfp4_moe/moe_cpu.cpp) and the dense decode stack (kernels/decode_layers/layers_cpu.cpp):
// the kinds of kernels/mxfp4_moe reference.glu, vectorised with vec_math.h's exp/tanh.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace localmoe {

enum Glu : int { kSwiGLU = 0, kGptOss = 1, kSiTU = 2 };

// 8 elements: h = glu(g, u). p0, p1: swiglu (limit or 0, -), gpt-oss (limit, alpha), SiTU (beta, linear beta).
inline __m256 glu8(int kind, __m256 g, __m256 u, float p0, float p1) {
  if (kind == kSiTU) {
    const __m256 b = _mm256_set1_ps(p0), lb = _mm256_set1_ps(p1);
    const __m256 tg = _mm256_mul_ps(b, localmoe::tanh_ps(_mm256_div_ps(g, b)));
    const __m256 tu = _mm256_mul_ps(lb, localmoe::tanh_ps(_mm256_div_ps(u, lb)));
    return _mm256_mul_ps(_mm256_mul_ps(tg, localmoe::sigmoid_ps(g)), tu);
  }
  if (p0 > 0.0f) {  // clamp: gate above at the limit, up to +-limit
    const __m256 limit = _mm256_set1_ps(p0);
    g = _mm256_min_ps(g, limit);
    u = _mm256_min_ps(_mm256_max_ps(u, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
  }
  if (kind == kGptOss)  // (u + 1) * g * sigmoid(alpha g)
    return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0f)),
                         _mm256_mul_ps(g, localmoe::sigmoid_ps(_mm256_mul_ps(_mm256_set1_ps(p1), g))));
  return _mm256_mul_ps(_mm256_mul_ps(g, localmoe::sigmoid_ps(g)), u);  // silu(g) * u
}

// gate [n] <- glu(gate, up); the last partial vector goes through a padded copy (same arithmetic).
inline void glu_rows(int kind, float* gate, const float* up, int64_t n, float p0, float p1) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(gate + i, glu8(kind, _mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), p0, p1));
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {};
    std::memcpy(g, gate + i, (n - i) * sizeof(float));
    std::memcpy(u, up + i, (n - i) * sizeof(float));
    _mm256_store_ps(g, glu8(kind, _mm256_load_ps(g), _mm256_load_ps(u), p0, p1));
    std::memcpy(gate + i, g, (n - i) * sizeof(float));
  }
}

}  // namespace localmoe
