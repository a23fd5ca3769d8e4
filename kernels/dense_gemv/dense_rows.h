// Dense GEMV rows (AVX2 + FMA) shared by the dense GEMV entry points (dense_cpu.cpp) and the fused
// attention decode step (kernels/gqa_decode/step_cpu.cpp): y[N, O] = x[N, K] W^T (+ b), W fp32 or
// bf16; how and why: dense_cpu.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "dense_tiles.h"
#include "pool.h"
#include "vec_math.h"

namespace localmoe_dense {

using localmoe::kChunkBytes;
using localmoe::parallel;

// One weight row w [K] against NT tokens x (row stride K): y[t * O] = dot(w, x_t) + bias (bias may
// be null). The row is one sequential stream (interleaving rows, or software prefetch, measured
// 0.6-0.7x of the plain stream). Every token's dot has the same summation order whatever NT (so a
// token's bits do not depend on the other rows of a call, engine/batch.py): 4 accumulators over
// 32-column steps (accumulator a takes columns k + 8a .. k + 8a + 7), the 8-column steps left over
// into accumulator 0, ((a0 + a1) + a2) + a3, a horizontal sum, then the scalar tail. The 16 ymm
// registers hold 4 accumulators for 1-2 tokens (one pass over the row, the single-token stream),
// so 3-4 tokens take two passes of 2 accumulators each and 5-8 tokens four passes of one (the
// later passes find the row in L1/L2).
template <typename T, int NT, int L>
inline void row_pass(const T* w, const float* x, int64_t K, int p, __m256 (*acc)[4]) {
  __m256 part[NT][L];
  for (int t = 0; t < NT; ++t)
    for (int l = 0; l < L; ++l) part[t][l] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256 wv[L];
    for (int l = 0; l < L; ++l) wv[l] = load8(w + k + 8 * (p * L + l));
    for (int t = 0; t < NT; ++t)
      for (int l = 0; l < L; ++l)
        part[t][l] = _mm256_fmadd_ps(wv[l], _mm256_loadu_ps(x + t * K + k + 8 * (p * L + l)), part[t][l]);
  }
  if (p == 0)
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = load8(w + k);
      for (int t = 0; t < NT; ++t) part[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * K + k), part[t][0]);
    }
  for (int t = 0; t < NT; ++t)
    for (int l = 0; l < L; ++l) acc[t][p * L + l] = part[t][l];
}

template <typename T, int NT>
inline void row(const T* w, const float* x, int64_t K, const float* bias, float* y, int64_t O) {
  constexpr int L = NT <= 2 ? 4 : (NT <= 4 ? 2 : 1);  // accumulators per token in one pass
  __m256 acc[NT][4];
  for (int p = 0; p < 4 / L; ++p) row_pass<T, NT, L>(w, x, K, p, acc);
  const int64_t k = K / 8 * 8;  // the scalar tail's first column
  for (int t = 0; t < NT; ++t) {
    __m256 sum = acc[t][0];
    for (int a = 1; a < 4; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
    float s = hsum(sum);
    for (int64_t j = k; j < K; ++j) s = __builtin_fmaf(load1(w + j), x[t * K + j], s);
    y[t * O] = bias == nullptr ? s : s + *bias;
  }
}

// Rows [o0, o1), each against all N tokens in groups of up to 8 (a group after the first finds the
// row in L1/L2).
template <typename T>
void gemv_rows(const void* ctx, int64_t o0, int64_t o1) {
  const Args<T>& a = *static_cast<const Args<T>*>(ctx);
  const int64_t K = a.K, O = a.O;
  // a switch, not a table of function pointers: a function-local static of an inline template is one object per
  // process (STB_GNU_UNIQUE), so with both ISA builds loaded one library would call the other's rows
  for (int64_t o = o0; o < o1; ++o) {
    const float* b = a.bias == nullptr ? nullptr : a.bias + o;
    for (int64_t t = 0; t < a.N; t += 8) {
      const T* w = a.w + o * K;
      const float* x = a.x + t * K;
      float* y = a.y + t * O + o;
      switch (std::min<int64_t>(8, a.N - t)) {
        case 1: row<T, 1>(w, x, K, b, y, O); break;
        case 2: row<T, 2>(w, x, K, b, y, O); break;
        case 3: row<T, 3>(w, x, K, b, y, O); break;
        case 4: row<T, 4>(w, x, K, b, y, O); break;
        case 5: row<T, 5>(w, x, K, b, y, O); break;
        case 6: row<T, 6>(w, x, K, b, y, O); break;
        case 7: row<T, 7>(w, x, K, b, y, O); break;
        default: row<T, 8>(w, x, K, b, y, O); break;
      }
    }
  }
}

// y [N, O] = x [N, K] W^T (+ bias): one token streams each weight row once (`row`); more take register tiles of
// tokens x outputs (dense_tiles.h), each token with the bits `row` gives it alone.
template <typename T>
void gemv(const float* x, int64_t N, int64_t K, const T* w, int64_t O, const float* bias, float* y, int threads) {
  if (N >= kTileMinRows) {
    gemv_tiles(x, N, K, w, O, bias, y, threads);
    return;
  }
  const Args<T> args{x, N, K, w, O, bias, y};
  parallel(gemv_rows<T>, &args, O, kChunkBytes / (K * static_cast<int64_t>(sizeof(T))), threads);
}

}  // namespace localmoe_dense
