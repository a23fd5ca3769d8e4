// Dense multi-row GEMV in register tiles (dense_rows.h's `gemv` for N >= kTileMinRows): y[N, O] = x[N, K] W^T
// (+ b), W fp32 or bf16, each token's dot in exactly the order of its one-row GEMV (`row`), so a token has the
// same bits alone, among others, in any tile and on AVX2 or AVX-512.
//
// `row`'s order, per (token, output): 32 lanes (4 accumulators of 8: accumulator a takes columns k + 8a ..
// k + 8a + 7 of every 32-column step), each lane a chain of FMAs over the steps in column order; the 8-column
// steps left over into accumulator 0; ((a0 + a1) + a2) + a3; a horizontal sum; the scalar tail; + bias. A tile
// here holds R tokens x C outputs and runs the lanes in 32 / kLanes passes (AVX-512: lanes 0-15 then 16-31 in one
// zmm per pair; AVX2: one ymm accumulator per pass): per 32-column step it loads C weight vectors and R x vectors
// for R x C FMAs, where `row` loads one x vector per FMA (its FMAs wait on x from L2 past a few tokens). The lanes
// of every chain see the same FMAs in the same order, so the pass split does not change a bit; the leftover steps,
// the sums and the tail then run per pair as in `row`.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pool.h"
#include "vec_math.h"

namespace localmoe_dense {

using localmoe::hsum;
using localmoe::hsum8;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32, exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
// 4 tokens x 5 outputs: 20 accumulators + 5 weight vectors + x, 26 of 32 zmm. Per 32-column step 9 vector loads
// feed 20 FMAs (6 x 4: 10 for 24): Zen 4 loads one zmm a cycle and x streams from L2; 4 x 5 ran 1.05-1.12x 6 x 4
// on Qwen3-Next / Kimi-Linear shapes at 72-512 tokens (session 13, docs/performance.md)
constexpr int kTileRows = 4, kTileOuts = 5;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {  // 16 bf16 -> 16 fp32, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kTileRows = 3, kTileOuts = 3;  // 9 accumulators + 3 weight vectors + x: 13 of 16 ymm
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int kTileMinRows = 3;  // tokens from which `gemv` takes the tiles (1-2 stream W faster through `row`: one stream)

// The 32 lanes lanes[r][c][0..31] of tokens x[0..R) (row stride K) against weight rows w[0..C) (row stride K),
// over the whole 32-column steps of K.
template <typename T, int R, int C>
inline void tile_lanes(const T* w, const float* x, int64_t K, float (*lanes)[kTileOuts][32]) {
  for (int p = 0; p < 32 / kLanes; ++p) {
    Vec acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = vzero();
    for (int64_t k = p * kLanes; k + 32 - p * kLanes <= K; k += 32) {
      Vec wv[C];
      for (int c = 0; c < C; ++c) wv[c] = vload(w + c * K + k);
      for (int r = 0; r < R; ++r) {
        const Vec xv = vload(x + r * K + k);
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(wv[c], xv, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) vstore(lanes[r][c] + p * kLanes, acc[r][c]);
  }
}

// One (token, output)'s result from its 32 lanes, as `row` ends: leftover 8-column steps into lanes 0-7, the
// four accumulators summed in order, the horizontal sum, the scalar tail, the bias.
template <typename T>
inline float tile_finish(const float* lanes, const T* w, const float* x, int64_t K, const float* bias) {
  __m256 a0 = _mm256_loadu_ps(lanes);
  int64_t k = K / 32 * 32;
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
  __m256 sum = _mm256_add_ps(a0, _mm256_loadu_ps(lanes + 8));
  sum = _mm256_add_ps(sum, _mm256_loadu_ps(lanes + 16));
  sum = _mm256_add_ps(sum, _mm256_loadu_ps(lanes + 24));
  float s = hsum(sum);
  for (; k < K; ++k) s = __builtin_fmaf(load1(w + k), x[k], s);
  return bias == nullptr ? s : s + *bias;
}

// ((a0 + a1) + a2) + a3 of one (token, output)'s 32 lanes, for K a multiple of 32 (no leftover steps).
inline __m256 lane_sum(const float* lanes) {
  __m256 s = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
  s = _mm256_add_ps(s, _mm256_loadu_ps(lanes + 16));
  return _mm256_add_ps(s, _mm256_loadu_ps(lanes + 24));
}

// y[r * O + c] for tokens x[0..R) and outputs w[0..C) (row o of W at w + c * K, its bias at bias + c).
template <typename T, int R, int C>
inline void tile(const T* w, const float* x, int64_t K, const float* bias, float* y, int64_t O) {
  alignas(64) float lanes[kTileRows][kTileOuts][32];
  tile_lanes<T, R, C>(w, x, K, lanes);
  if (K % 32 == 0 && R * C >= 8) {  // no leftover steps or tail: the horizontal sums 8 pairs at a time
    constexpr int P = R * C;
    float s[(P + 7) / 8 * 8];
    for (int p0 = 0; p0 < P; p0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) {
        const int p = std::min(p0 + i, P - 1);  // the last group padded with the last pair
        v[i] = lane_sum(lanes[p / C][p % C]);
      }
      hsum8(v, s + p0);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r * O + c] = bias == nullptr ? s[r * C + c] : s[r * C + c] + bias[c];
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[r * O + c] = tile_finish(lanes[r][c], w + c * K, x + r * K, K, bias == nullptr ? nullptr : bias + c);
}

// A switch, not a table of function pointers: a function-local static in an inline template is one object for the
// whole process (STB_GNU_UNIQUE), so the AVX2 and AVX-512 libraries loaded together (tests) would share one table.
template <typename T, int C>
inline void tile_rows(int R, const T* w, const float* x, int64_t K, const float* bias, float* y, int64_t O) {
  static_assert(kTileRows <= 6, "tile_rows covers up to 6 tokens");
  switch (R) {
    case 1: return tile<T, 1, C>(w, x, K, bias, y, O);
    case 2: return tile<T, 2, C>(w, x, K, bias, y, O);
    case 3: return tile<T, 3, C>(w, x, K, bias, y, O);
    case 4: return tile<T, kTileRows >= 4 ? 4 : 1, C>(w, x, K, bias, y, O);
    case 5: return tile<T, kTileRows >= 5 ? 5 : 1, C>(w, x, K, bias, y, O);
    default: return tile<T, kTileRows >= 6 ? 6 : 1, C>(w, x, K, bias, y, O);
  }
}

// One GEMV call's arguments (also dense_rows.h's one-row-at-a-time form).
template <typename T>
struct Args {
  const float* x;
  int64_t N, K;
  const T* w;
  int64_t O;
  const float* bias;
  float* y;
};

constexpr int64_t kTileTokenBytes = 256 << 10;  // x bytes per block of tokens: stays in L2 with the chunk's weight rows

// Outputs [o0, o1) against all N tokens: the tokens in blocks of kTileTokenBytes of x (a prompt chunk of 512
// tokens is 1.5 MiB of x at K = 768: it would stream from L3 for every weight tile); per block, kTileOuts weight
// rows at a time (the last few one by one), each against the block's tokens in groups of at most kTileRows, as even
// as they go (7 tokens: 4 + 3; 9: 3 + 3 + 3, not 4 + 4 + 1), the weight rows staying in L1 while x streams from L2
// (the chunk's rows come back from L2 for the next block). Which tile and block a token falls in does not change
// its bits.
template <typename T>
void tile_outputs(const void* ctx, int64_t o0, int64_t o1) {
  const Args<T>& a = *static_cast<const Args<T>*>(ctx);
  const int64_t K = a.K, O = a.O, N = a.N;
  const int64_t block = std::max<int64_t>(kTileRows, kTileTokenBytes / (4 * K) / kTileRows * kTileRows);
  for (int64_t t0 = 0; t0 < N; t0 += block) {
    const int64_t t1 = std::min(N, t0 + block);
    for (int64_t o = o0; o < o1;) {
      const bool full = o + kTileOuts <= o1;
      const T* w = a.w + o * K;
      const float* b = a.bias == nullptr ? nullptr : a.bias + o;
      const int64_t groups = (t1 - t0 + kTileRows - 1) / kTileRows;
      // The next output block's weight rows (within [o0, o1)) into L2, a share per token group: without it each block
      // started on rows cold from RAM (the hardware prefetchers had not run ahead) and the tiles ran ~1.07x slower at
      // 72 tokens, ~1.2-1.7x at 5-16 (docs/performance.md, session 15).
      const char* next = reinterpret_cast<const char*>(a.w + (o + kTileOuts) * K);
      const int64_t next_bytes = std::min<int64_t>(kTileOuts, std::max<int64_t>(0, o1 - o - kTileOuts)) * K *
                                 static_cast<int64_t>(sizeof(T));
      for (int64_t t = t0, g = 0; t < t1; ++g) {
        for (int64_t b = next_bytes * g / groups / 64 * 64; b < next_bytes * (g + 1) / groups; b += 64)
          _mm_prefetch(next + b, _MM_HINT_T1);
        const int R = static_cast<int>((t1 - t + (groups - g) - 1) / (groups - g));
        if (full)
          tile_rows<T, kTileOuts>(R, w, a.x + t * K, K, b, a.y + t * O + o, O);
        else
          tile_rows<T, 1>(R, w, a.x + t * K, K, b, a.y + t * O + o, O);
        t += R;
      }
      o += full ? kTileOuts : 1;
    }
  }
}

template <typename T>
void gemv_tiles(const float* x, int64_t N, int64_t K, const T* w, int64_t O, const float* bias, float* y,
                int threads) {
  const Args<T> args{x, N, K, w, O, bias, y};
  int64_t chunk = localmoe::kChunkBytes / (K * static_cast<int64_t>(sizeof(T)));
  chunk = std::max<int64_t>(kTileOuts, chunk / kTileOuts * kTileOuts);
  localmoe::parallel(tile_outputs<T>, &args, O, chunk, threads);
}

}  // namespace localmoe_dense
