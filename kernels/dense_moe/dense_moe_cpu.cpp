// Routed experts with dense fp32 / bf16 matrices for a prefill chunk (AVX2 + FMA): one call per expert
// computes every token routed to it, out[rows[n]] += weights[n] * down(glu(gate x_n, up x_n)).
//
// Per-expert torch F.linear over its few tokens (~9 of a 72-token chunk) reached ~0.35 of the weight
// read bandwidth with the weights streaming from RAM. Here each weight row is read once for all of the
// expert's tokens: blocks of R rows x NT tokens keep R * NT fp32 accumulators in registers, so an 8-column
// step is R weight loads + NT x loads for R * NT FMAs. Each (row, token) dot is one accumulator over K
// in order, so a token's bits do not depend on N, the blocking or the thread count. gate and up rows are
// computed together, their GLU applied per chunk of rows (elementwise), then the down rows add straight
// into `out` (a token picks an expert once, and a row belongs to one thread: no races).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../dense_gemv/dense_rows.h"
#include "expert_rows.h"
#include "glu.h"

namespace {

using localmoe_dense::load1;
using localmoe_dense::load8;

// R rows x NT tokens: R * NT accumulators + R weight vectors + 1 x vector. AVX2 has 16 ymm registers (3 x 3);
// the AVX-512 build's VL encoding reaches 32, so it takes 3 x 9 (a whole expert's ~9 prefill tokens in one pass:
// each weight vector loaded from RAM feeds 9 FMAs). Each dot is the same 8-lane accumulation either way: the two
// builds give the same bits.
#ifdef __AVX512VL__
constexpr int kRows = 3, kTokens = 9;
#else
constexpr int kRows = 3, kTokens = 3;
#endif

// dots[t * R + r] = w_r . x_t for R rows of w (stride K) and NT tokens of x (stride K). Rows set in `prefetch`
// (bit r: row r) of the block two ahead are prefetched along the way into L2 (measured: one and four ahead were
// slower; into L1, _MM_HINT_T0, a Kimi-Linear small layer's experts from RAM ran 1.5x slower).
template <typename T, int R, int NT>
inline void block(const T* w, const float* x, int64_t K, float* dots, unsigned prefetch) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
    if (prefetch && k % (64 / sizeof(T)) == 0)  // once per 64-byte line (was every 8 columns: 2-4x the prefetches)
      for (int r = 0; r < R; ++r)
        if (prefetch >> r & 1u) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * R + r) * K + k), _MM_HINT_T1);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = localmoe::hsum(acc[r][t]);
      for (int64_t j = k; j < K; ++j) s = __builtin_fmaf(load1(w + r * K + j), x[t * K + j], s);
      dots[t * R + r] = s;
    }
}

// block<T, R, n> for 1 <= n <= NT.
template <typename T, int R, int NT = kTokens>
inline void block_n(int n, const T* w, const float* x, int64_t K, float* dots, unsigned prefetch) {
  if constexpr (NT > 1) {
    if (n < NT) return block_n<T, R, NT - 1>(n, w, x, K, dots, prefetch);
  }
  block<T, R, NT>(w, x, K, dots, prefetch);
}

// The R rows against N tokens, in groups of at most kTokens, as even as they go (10 tokens: 5 + 5, not 9 + 1).
// The prefetches of the rows two blocks ahead are spread over the groups (group g takes rows g, g + G, ...): the
// memory stream runs while every group computes, not only the first (with all prefetches in the first group the
// stream idled during the later ones).
template <typename T, int R>
inline void rows_block(const T* w, const float* x, int64_t N, int64_t K, float* dots) {
  const int64_t groups = (N + kTokens - 1) / kTokens;
  for (int64_t t = 0, g = 0; t < N; ++g) {
    const int64_t n = (N - t + (groups - g) - 1) / (groups - g);
    unsigned prefetch = 0;
    for (int r = 0; r < R; ++r)
      if (r % groups == g) prefetch |= 1u << r;
    block_n<T, R>(static_cast<int>(n), w, x + t * K, K, dots + t * R, prefetch);
    t += n;
  }
}

// dots [N][R'] for rows [o, o + R') of w, R' = min(kRows, O - o); returns R'.
template <typename T>
inline int rows_at(const T* w, int64_t o, int64_t O, const float* x, int64_t N, int64_t K, float* dots) {
  const int R = static_cast<int>(std::min<int64_t>(kRows, O - o));
  if (R == 3) rows_block<T, 3>(w + o * K, x, N, K, dots);
  else if (R == 2) rows_block<T, 2>(w + o * K, x, N, K, dots);
  else rows_block<T, 1>(w + o * K, x, N, K, dots);
  return R;
}

template <typename T>
struct Expert {
  const float* xs;  // [N, D] the expert's tokens
  const int64_t* rows;
  const float* weights;
  int64_t N, D, I;
  const T *gate, *up, *down;
  int glu;
  float p0, p1;
  float *g, *u;  // [N, I]
  float* out;    // [*, D]
};

template <typename T>
void gate_up_rows(const void* ctx, int64_t o0, int64_t o1) {
  const Expert<T>& e = *static_cast<const Expert<T>*>(ctx);
  float dots[2][64 * kRows];
  for (int64_t t0 = 0; t0 < e.N; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, e.N - t0);
    for (int64_t o = o0; o < o1;) {
      rows_at(e.gate, o, o1, e.xs + t0 * e.D, n, e.D, dots[0]);
      const int R = rows_at(e.up, o, o1, e.xs + t0 * e.D, n, e.D, dots[1]);
      for (int64_t t = 0; t < n; ++t)
        for (int r = 0; r < R; ++r) {
          e.g[(t0 + t) * e.I + o + r] = dots[0][t * R + r];
          e.u[(t0 + t) * e.I + o + r] = dots[1][t * R + r];
        }
      o += R;
    }
  }
  for (int64_t t = 0; t < e.N; ++t) localmoe::glu_rows(e.glu, e.g + t * e.I + o0, e.u + t * e.I + o0, o1 - o0, e.p0, e.p1);
}

template <typename T>
void down_rows(const void* ctx, int64_t o0, int64_t o1) {
  const Expert<T>& e = *static_cast<const Expert<T>*>(ctx);
  float dots[64 * kRows];
  for (int64_t t0 = 0; t0 < e.N; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, e.N - t0);
    for (int64_t o = o0; o < o1;) {
      const int R = rows_at(e.down, o, o1, e.g + t0 * e.I, n, e.I, dots);
      for (int64_t t = 0; t < n; ++t) {
        float* y = e.out + e.rows[t0 + t] * e.D + o;
        const float wt = e.weights[t0 + t];
        for (int r = 0; r < R; ++r) {
          const float p = wt * dots[t * R + r];  // rounded, then added: torch's y * w, then index_add_
          y[r] += p;
        }
      }
      o += R;
    }
  }
}

template <typename T>
void expert(const Expert<T>& e, int threads) {
  const int64_t row_bytes = static_cast<int64_t>(sizeof(T));
  const int64_t gu = std::max<int64_t>(kRows, localmoe::kChunkBytes / (2 * e.D * row_bytes) / kRows * kRows);
  localmoe::parallel(gate_up_rows<T>, &e, e.I, gu, threads);
  const int64_t dn = std::max<int64_t>(kRows, localmoe::kChunkBytes / (e.I * row_bytes) / kRows * kRows);
  localmoe::parallel(down_rows<T>, &e, e.D, dn, threads);
}

// One expert over its N tokens (rows into x / out, weights): gathers the rows into scratch, then gate/up and down.
void run_expert(const float* x, int64_t D, const int64_t* rows, const float* weights, int64_t N, const void* gate,
                const void* up, const void* down, int bf16, int64_t I, int glu, float p0, float p1, float* out,
                float* scratch, int threads) {
  if (N <= 0) return;
  float* xs = scratch;
  for (int64_t n = 0; n < N; ++n) std::memcpy(xs + n * D, x + rows[n] * D, D * sizeof(float));
  float *g = xs + N * D, *u = g + N * I;
  if (bf16) {
    const Expert<uint16_t> e{xs, rows, weights, N, D, I, static_cast<const uint16_t*>(gate),
                             static_cast<const uint16_t*>(up), static_cast<const uint16_t*>(down), glu, p0, p1, g, u, out};
    expert(e, threads);
  } else {
    const Expert<float> e{xs, rows, weights, N, D, I, static_cast<const float*>(gate), static_cast<const float*>(up),
                          static_cast<const float*>(down), glu, p0, p1, g, u, out};
    expert(e, threads);
  }
}

}  // namespace

extern "C" {

// Floats of scratch `dense_moe_expert` needs for N tokens, width D, intermediate I.
int64_t dense_moe_scratch(int64_t N, int64_t D, int64_t I) { return N * (D + 2 * I); }

// out [*, D] += weights[n] * down(glu(gate x[rows[n]], up x[rows[n]])) for n < N; x [*, D] fp32; gate, up
// [I, D], down [D, I] fp32 (bf16 = 0) or bf16 bits (bf16 = 1), contiguous; scratch: dense_moe_scratch floats.
// glu, p0, p1: kernels/_cpu/glu.h. rows may repeat (a token routed twice to one expert): each pick adds its term.
void dense_moe_expert(const float* x, int64_t D, const int64_t* rows, const float* weights, int64_t N,
                      const void* gate, const void* up, const void* down, int bf16, int64_t I, int glu, float p0,
                      float p1, float* out, float* scratch, int threads) {
  run_expert(x, D, rows, weights, N, gate, up, down, bf16, I, glu, p0, p1, out, scratch, threads);
}

// Floats of scratch `dense_moe_layer` needs for T tokens, width D, intermediate I.
int64_t dense_moe_layer_scratch(int64_t T, int64_t D, int64_t I) { return T * (D + 2 * I + 3); }

// A MoE layer's routed experts from one call: for each expert e of experts[0..M) in that order (increasing ids:
// the order a per-expert dispatch adds them), its picks (ids [T, k], weights [T, k]: every (t, j) with ids[t, j]
// == e, in increasing t then j, kernels/_cpu/expert_rows.h; a token that names e twice gets it twice) through
// `dense_moe_expert`'s computation, in pieces of at most T rows (a token's row does not depend on the rows beside
// it, and a piece's adds into `out` run in its order on the thread that owns the output column): the same bits
// as one dense_moe_expert call per expert. table [E, 3]: addresses of each expert's gate, up, down (all fp32 or
// all bf16, per `bf16`).
void dense_moe_layer(const float* x, int64_t D, const int64_t* ids, const float* weights, int64_t T, int64_t k,
                     const int64_t* table, const int64_t* experts, int64_t M, int bf16, int64_t I, int glu, float p0,
                     float p1, float* out, float* scratch, int threads) {
  int64_t* rows = reinterpret_cast<int64_t*>(scratch);
  float* wts = scratch + 2 * T;
  float* work = wts + T;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t* w = table + 3 * experts[m];
    localmoe_moe::for_expert_rows(ids, weights, T, k, experts[m], T, rows, wts, [&](const int64_t* r, const float* wt,
                                                                                     int64_t n) {
      run_expert(x, D, r, wt, n, reinterpret_cast<const void*>(w[0]), reinterpret_cast<const void*>(w[1]),
                 reinterpret_cast<const void*>(w[2]), bf16, I, glu, p0, p1, out, work, threads);
      return true;
    });
  }
}

}  // extern "C"
