// A MoE layer's routed experts straight from GGUF blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K /
// Q6_K: ggml_rows.h) for one decode token, in one call: the token's input is rounded to int8 once and read by
// the gate and up rows of every chosen expert in ONE pass over the pool, the GLU runs per expert, each expert's
// activation is rounded once, the down rows of every expert run in a second pass, and the weighted outputs are
// added in the order given (the caller's: increasing expert id, as engine/layers/moe.py dispatch adds them).
//
// Every matrix row goes through the same int8 row kernel as `ggml_gemv` for one token (dot_tokens_int8 with
// one token), so a chosen expert gives the bits of three ggml_gemv / matvec calls + glu_rows + out += w y:
// exactly what hybrid_cpu.cpp `dense_expert` computes for an expert handed to the decode step's callback (a
// pager's), so paged decode equals resident decode bit for bit. Rows are computed whole by one thread: the
// bits do not depend on the thread count. Where llama.cpp (ggml_mul_mat_id) also rounds the input once per
// token for all experts, the op-by-op engine rounds it per projection (the same values, twice the work).
//
// Expert table: int64 [E, 3] addresses of each expert's gate [I, W], up [I, W], down [W, I] raw blocks (rows of
// row_bytes(type, cols / 32)); types[3] the GGMLQuantizationType of gate, up and down (one per projection for
// the whole layer: a Q4_K_M file's down may be Q6_K where its gate and up are Q4_K).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "expert_rows.h"
#include "ggml_rows.h"
#include "glu.h"
#include "pool.h"

namespace {

using namespace localmoe_ggml;

typedef void (*RowFn)(const uint8_t* w, int64_t row_bytes, int64_t units, const Tile& x, int64_t r0, int64_t r1,
                      float* y);

template <class U>
void one_row(const uint8_t* w, int64_t row_bytes, int64_t units, const Tile& x, int64_t r0, int64_t r1, float* y) {
  rows_one_token<U>(w, row_bytes, units, x, r0, r1, y);
}

RowFn row_fn(int type) {
  switch (type) {
    case kQ4_0: return one_row<Block32Int8<kQ4_0>>;
    case kQ4_1: return one_row<Block32Int8<kQ4_1>>;
    case kQ4_1_R8: return one_row<Rows8R8<kQ4_1>>;
    case kQ5_0: return one_row<Block32Int8<kQ5_0>>;
    case kQ5_1: return one_row<Block32Int8<kQ5_1>>;
    case kQ8_0: return one_row<Block32Int8<kQ8_0>>;
    case kQ4_K: return one_row<Rows8K>;
    case kQ4_K_R8: return one_row<Rows8KR8>;
    case kQ5_K: return one_row<Rows8K5>;
    case kQ6_K: return one_row<Rows8K6>;
    case kQ6_K_R8: return one_row<Rows8K6R8>;
    case kIQ4_NL: return one_row<RowsIQ4<kIQ4_NL>>;
    case kIQ4_XS: return one_row<RowsIQ4<kIQ4_XS>>;
    default: return nullptr;
  }
}

int64_t align64(int64_t bytes) { return (bytes + 63) & ~int64_t{63}; }

// One token's x rounded as `gemv` rounds it for N = 1, per 32 values and / or per 256 (for K-quant rows).
struct Rounded {
  XQ per32{}, per256{};

  static int64_t bytes(int64_t K) { return 2 * align64(scratch_bytes(1, K)); }
  Rounded(void* base, const float* x, int64_t K, bool blocks32, bool super256) {
    if (blocks32) per32 = round_x(x, 1, K, false, base);
    if (super256) per256 = round_x(x, 1, K, true, static_cast<char*>(base) + align64(scratch_bytes(1, K)));
  }
  // The tile the rows of `type` read.
  Tile tile(int type) const {
    Tile t{};
    tile_token(t, is_k_quant(type) ? per256 : per32, 0, 0);
    t.s = per32.s;
    t.padded = 8;
    return t;
  }
};

// A pass over the rows of n matrices (one or two per chosen expert) that share a shape: row r is row r % O of
// matrix r / O, read against tiles[r / O].
struct Pass {
  const uint8_t* data[128];
  RowFn fn[128];
  int64_t row_bytes[128], units[128];
  Tile tiles[128];
  int64_t O, n;  // rows per matrix, matrices
  float* y;  // [n * O]
};

void pass_rows(const void* ctx, int64_t r0, int64_t r1) {
  const Pass& p = *static_cast<const Pass*>(ctx);
  for (int64_t r = r0; r < r1;) {  // a run of rows of one matrix at a time
    const int64_t m = r / p.O, o0 = r % p.O, o1 = std::min(p.O, o0 + (r1 - r));
    if (o1 == p.O && m + 1 < p.n)  // the matrix ends in this run: the next one's first rows (the row kernels fetch ahead
      prefetch_ahead(p.data[m + 1], kAheadRows * p.row_bytes[m + 1]);  // only within a matrix)
    p.fn[m](p.data[m], p.row_bytes[m], p.units[m], p.tiles[m], o0, o1, p.y + m * p.O);
    r += o1 - o0;
  }
}

int64_t units_of(int type, int64_t cols) { return cols / kBlock / (is_k_quant(type) ? 8 : 1); }

// Rows per chunk of a pass over matrices of `type` with rows of row_bytes: whole groups of eight where the type's rows
// run eight at a time (has_rows8; a range's leftover rows would run alone, slower).
int64_t pass_chunk(int type, int64_t row_bytes) {
  const int64_t chunk = std::max<int64_t>(1, localmoe::kChunkBytes / std::max<int64_t>(1, row_bytes));
  return has_rows8(type) ? (chunk + 7) / 8 * 8 : chunk;
}

}  // namespace

extern "C" {

// Bytes of scratch ggml_moe_token needs for k experts of width W and inner size I.
int64_t ggml_moe_token_scratch(int64_t k, int64_t W, int64_t I) {
  return 64 + align64(Rounded::bytes(W)) + k * align64(Rounded::bytes(I)) + align64(k * (2 * I + W) * 4);
}

// out [W] += sum over j < k of weights[j] * down_e(glu(gate_e x, up_e x)), e = ids[j], in the order of j; x [W]
// fp32; table [E, 3], types[3]: see the top of this file; glu: glu.h kind with p0, p1; k <= 64. Returns 0, or
// -1 for a type without an int8 row kernel, K not a whole number of blocks, or k > 64.
int ggml_moe_token(const float* x, int64_t W, int64_t I, const int64_t* ids, const float* weights, int64_t k,
                   const int64_t* table, const int64_t* types, int glu, float p0, float p1, float* out, void* scratch,
                   int threads) {
  const RowFn fns[3] = {row_fn(static_cast<int>(types[0])), row_fn(static_cast<int>(types[1])),
                        row_fn(static_cast<int>(types[2]))};
  const auto whole = [&](int p, int64_t cols) { return cols % (is_k_quant(static_cast<int>(types[p])) ? 256 : kBlock) == 0; };
  if (!fns[0] || !fns[1] || !fns[2] || k > 64 || k < 0 || !whole(0, W) || !whole(1, W) || !whole(2, I)) return -1;
  if (k == 0) return 0;
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  const int t0 = static_cast<int>(types[0]), t1 = static_cast<int>(types[1]), t2 = static_cast<int>(types[2]);
  const Rounded xr(base, x, W, !is_k_quant(t0) || !is_k_quant(t1), is_k_quant(t0) || is_k_quant(t1));
  base += align64(Rounded::bytes(W));
  char* inner = base;
  base += k * align64(Rounded::bytes(I));
  float* gu = reinterpret_cast<float*>(base);  // [k, 2 I]: gate | up per expert, then the GLU in the gate half
  float* y = gu + k * 2 * I;                  // [k, W]

  Pass first{};
  first.O = I, first.n = 2 * k, first.y = gu;
  for (int64_t j = 0; j < k; ++j)
    for (int p = 0; p < 2; ++p) {
      const int64_t m = 2 * j + p;
      first.tiles[m] = xr.tile(p == 0 ? t0 : t1);
      first.data[m] = reinterpret_cast<const uint8_t*>(table[3 * ids[j] + p]);
      first.fn[m] = fns[p];
      first.row_bytes[m] = row_bytes(static_cast<int>(types[p]), W / kBlock);
      first.units[m] = units_of(static_cast<int>(types[p]), W);
    }
  localmoe::parallel(pass_rows, &first, 2 * k * I, pass_chunk(t0, first.row_bytes[0]), threads);

  Pass second{};
  second.O = W, second.n = k, second.y = y;
  for (int64_t j = 0; j < k; ++j) {
    float* g = gu + j * 2 * I;
    localmoe::glu_rows(glu, g, g + I, I, p0, p1);
    second.tiles[j] = Rounded(inner + j * align64(Rounded::bytes(I)), g, I, !is_k_quant(t2), is_k_quant(t2)).tile(t2);
    second.data[j] = reinterpret_cast<const uint8_t*>(table[3 * ids[j] + 2]);
    second.fn[j] = fns[2];
    second.row_bytes[j] = row_bytes(static_cast<int>(types[2]), I / kBlock);
    second.units[j] = units_of(static_cast<int>(types[2]), I);
  }
  localmoe::parallel(pass_rows, &second, k * W, pass_chunk(t2, second.row_bytes[0]), threads);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < W; ++i) out[i] += weights[j] * y[j * W + i];
  return 0;
}

}  // extern "C"

extern "C" {

// Bytes of scratch ggml_moe_expert needs for n tokens of width W and inner size I.
int64_t ggml_moe_expert_scratch(int64_t n, int64_t W, int64_t I) {
  return 64 + align64(n * W * 4) + align64(n * (2 * I + W) * 4) + align64(scratch_bytes(n, std::max(W, I)));
}

// One expert over a chunk's tokens (prefill): out[rows[i]] += weights[i] * down(glu(gate x_r, up x_r)) for the
// n tokens rows[i] of x [T, W], in the order of i; gate / up / down the expert's blocks of types[3]. Each
// projection is one `gemv` over the n gathered rows (the multi-row int8 kernel: a weight block decoded once
// per tile of tokens), so a row has the bits it has alone. Returns 0, or -1 as ggml_moe_token.
int ggml_moe_expert(const float* x, int64_t W, int64_t I, const int64_t* rows, const float* weights, int64_t n,
                    const int64_t* expert, const int64_t* types, int glu, float p0, float p1, float* out, void* scratch,
                    int threads) {
  const auto whole = [&](int p, int64_t cols) { return cols % (is_k_quant(static_cast<int>(types[p])) ? 256 : kBlock) == 0; };
  for (int p = 0; p < 3; ++p)
    if (!row_fn(static_cast<int>(types[p]))) return -1;
  if (!whole(0, W) || !whole(1, W) || !whole(2, I) || n < 0) return -1;
  if (n == 0) return 0;
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  float* xg = reinterpret_cast<float*>(base);
  float* g = reinterpret_cast<float*>(base + align64(n * W * 4));  // [n, I] gate, then the GLU
  float* u = g + n * I;                                            // [n, I]
  float* y = u + n * I;                                            // [n, W]
  void* sq = base + align64(n * W * 4) + align64(n * (2 * I + W) * 4);
  for (int64_t i = 0; i < n; ++i) std::memcpy(xg + i * W, x + rows[i] * W, W * sizeof(float));
  const auto at = [&](int p) { return reinterpret_cast<const uint8_t*>(expert[p]); };
  gemv(xg, n, W, at(0), static_cast<int>(types[0]), I, nullptr, g, sq, threads);
  gemv(xg, n, W, at(1), static_cast<int>(types[1]), I, nullptr, u, sq, threads);
  localmoe::glu_rows(glu, g, u, n * I, p0, p1);
  gemv(g, n, I, at(2), static_cast<int>(types[2]), W, nullptr, y, sq, threads);
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + rows[i] * W;
    for (int64_t d = 0; d < W; ++d) dst[d] += weights[i] * y[i * W + d];
  }
  return 0;
}

}  // extern "C"

extern "C" {

// Bytes of scratch ggml_moe_layer needs for a chunk of T tokens (k experts each) of width W and inner size I.
int64_t ggml_moe_layer_scratch(int64_t T, int64_t k, int64_t W, int64_t I) {
  return ggml_moe_expert_scratch(T, W, I) + align64(T * 8) + align64(T * 4);
}

// A chunk's routed experts from their blocks (prefill), one call for the layer: for each expert e of
// experts[0 .. n) in that order, its picks (expert_rows.h: every (t, j) with ids[t, j] == e, in order; ids [T, k],
// weights [T, k]) go through ggml_moe_expert with the expert's table row (table [E, 3] as ggml_moe_token's):
// out [T, W] += the weighted outputs, each expert's blocks read once for all its tokens. The bits of one
// ggml_moe_expert call per expert in the same order (the per-expert path: a pager's experts). Returns 0, or -1 as
// ggml_moe_expert (nothing is added for the experts from the refused one on).
int ggml_moe_layer(const float* x, int64_t T, int64_t W, int64_t I, const int64_t* ids, const float* weights, int64_t k,
                   const int64_t* experts, int64_t n, const int64_t* table, const int64_t* types, int glu, float p0,
                   float p1, float* out, void* scratch, int threads) {
  char* base = static_cast<char*>(scratch);
  int64_t* rows = reinterpret_cast<int64_t*>(base);
  float* w = reinterpret_cast<float*>(base + align64(T * 8));
  void* rest = base + align64(T * 8) + align64(T * 4);  // ggml_moe_expert aligns it itself
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = experts[i];
    const auto run = [&](const int64_t* r, const float* wt, int64_t m) {
      return ggml_moe_expert(x, W, I, r, wt, m, table + 3 * e, types, glu, p0, p1, out, rest, threads) == 0;
    };
    if (!localmoe_moe::for_expert_rows(ids, weights, T, k, e, T, rows, w, run)) return -1;
  }
  return 0;
}

}  // extern "C"
