// A whole MoE layer's routed experts on the CPU in one call (AVX2 + FMA, or AVX-512 VNNI), straight from MXFP4.
//
// out [N, D] += sum over assignments (t, j) of weights[t, j] * down(glu(gate x_t, up x_t)) of
// expert ids[t, j]. Called once per layer instead of ~4 small GEMVs, an activation and a scatter
// per expert from Python: decode of a small MoE spent more time in that Python than in the bytes.
//
// Order (it fixes the bits): assignments are grouped by expert in increasing id, tokens in
// increasing order within an expert, and added to `out` in that order. `only` >= 0 computes just
// that expert's group: a paging provider, which holds one expert at a time, calls once per expert
// in increasing id and gets the same bits as one call over every expert. Within a group, its n
// tokens go through the GEMV's paths (mxfp4_rows.h: the integer path per token for n <= kTokenPathMax,
// fp32 blocks for more), each output row whole on one thread, so the bits depend on neither the thread count nor
// on which other experts share the call.
//
// Precision q8 (EngineConfig.expert_precision, the engine's default): each projection's input is
// rounded to int8 per 32-element block (mxfp4_q8.h, llama.cpp's Q8_0 trade) and every group, whatever
// its n, runs the u8 x s8 path over 8 blocks per fp32 step, each row's blocks decoded once for the
// group's tokens; a token's bits are the same whatever n (prefill = decode).
//
// Expert table: int64 [E, 9] of addresses: gate.{packed, scales, bias}, up.{...}, down.{...};
// packed/scales in the canonical layout (gate/up [I, D/2] and [I, D/32], down [D, I/2] and
// [D, I/32]); a bias is fp32 [out] or 0 for none. D and I are multiples of 32.
//
// The GLU runs here too, vectorised with one exp (Cephes-style polynomial, ~1 ulp) for every
// element wherever it sits in the buffer, so it too is independent of the grouping.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../dense_gemv/dense_rows.h"
#include "glu.h"
#include "mxfp4_q8.h"
#include "mxfp4_rows.h"
#include "pool.h"
#include "route.h"
#include "vec_math.h"

namespace {

using localmoe::kChunkBytes;
using localmoe::parallel;
using namespace localmoe_mxfp4;
using localmoe::glu_rows;

struct Group {
  int64_t expert, first, n;  // assignments [first, first + n) of the sorted order
};

// One matrix per expert, the same shape for all: y rows [first, first + n) of out (stride O) = the
// group's inputs (xq for n = 1, permuted xp otherwise, stride K) times W^T (+ bias).
struct Phase {
  const std::vector<Group>* groups;
  const int64_t* table;
  int nproj;                // 2: gate and up (rows [0, O) gate, [O, 2O) up); 1: down
  int proj0;                // table column block of the first projection (0: gate, 2: down)
  int64_t K, O;
  const float* xp;          // [M, K]
  const uint8_t* xq;        // [M] records of pairs_bytes(K), or of q8_bytes(K) when q8
  float* out[2];            // [M, O] per projection
  bool q8;
};

// Exact precision: an expert's group of up to this many tokens (every group of a batched step of up to 32
// rows: 16 decode rows and a prompt chunk's) runs the one-token integer path per token, so each token has the
// bits it has alone (engine/batch.py's row independence, kernels/mxfp4_moe EXACT_TOKEN_ROWS; row_f32's summation
// order depends on the group's size). Larger groups (prefill) share each block's fp32 decode among their tokens
// (row_tokens).
constexpr int64_t kTokenPathMax = 32;

// Rows [i0, i1) of the phase, numbered group-major, then projection, then output row: a chunk is walked
// as runs of consecutive rows of one (group, projection) matrix (one division per chunk, not three
// per row: with K = 768 a row is only ~60 cycles of work).
void phase_rows(const void* ctx, int64_t i0, int64_t i1) {
  const Phase& a = *static_cast<const Phase*>(ctx);
  const int64_t nb = a.K / kBlock, per_group = a.nproj * a.O, qbytes = pairs_bytes(a.K);
  int64_t gi = i0 / per_group, proj = (i0 % per_group) / a.O, o0 = i0 % a.O;
  for (int64_t i = i0; i < i1; gi += (++proj == a.nproj), proj %= a.nproj, o0 = 0) {
    const Group& g = (*a.groups)[gi];
    const int64_t* row = a.table + g.expert * 9 + 3 * (a.proj0 + proj);
    const uint8_t* packed = reinterpret_cast<const uint8_t*>(row[0]);
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(row[1]);
    const float* bias = reinterpret_cast<const float*>(row[2]);
    const int64_t o1 = std::min(a.O, o0 + (i1 - i));
    float* y0 = a.out[proj] + g.first * a.O;
    if (a.q8)
      matrix_q8(packed, scales, a.K, o0, o1, reinterpret_cast<const GroupQ8*>(a.xq + g.first * q8_bytes(a.K)), g.n,
                y0, a.O);
    else if (g.n <= kTokenPathMax)  // each token on its own: the bits it has alone
      for (int64_t t = 0; t < g.n; ++t)
        matrix_token(packed, scales, a.K, o0, o1, reinterpret_cast<const PairX*>(a.xq + (g.first + t) * qbytes),
                     y0 + t * a.O);
    else
      for (int64_t o = o0; o < o1; ++o)
        row_tokens(packed + o * (a.K / 2), scales + o * nb, nb, a.xp + g.first * a.K, g.n, a.K, y0 + o, a.O);
    if (bias != nullptr)
      for (int64_t o = o0; o < o1; ++o)
        for (int64_t t = 0; t < g.n; ++t) y0[t * a.O + o] += bias[o];
    i += o1 - o0;
  }
}

// The groups' inputs in the form their path reads: q8 records for every token when q8, else integer
// parts for the tokens of groups of up to kTokenPathMax and permuted fp32 rows otherwise. src(a) is assignment a's input row of K.
template <typename Src>
void prepare_inputs(const std::vector<Group>& groups, int64_t K, Src src, float* xp, uint8_t* xq, bool q8) {
  const int64_t qbytes = q8 ? q8_bytes(K) : pairs_bytes(K);
  for (const Group& g : groups)
    for (int64_t a = g.first; a < g.first + g.n; ++a) {
      if (q8)
        quantize_row_q8(src(a), K / kBlock, reinterpret_cast<GroupQ8*>(xq + a * qbytes));
      else if (g.n <= kTokenPathMax)
        quantize_row(src(a), K / kBlock, reinterpret_cast<PairX*>(xq + a * qbytes));
      else
        permute_blocks(src(a), 1, K, xp + a * K);
    }
}

inline int64_t align64(int64_t bytes) { return (bytes + 63) & ~int64_t{63}; }

struct Scratch {
  int64_t* order;  // [M] flat assignment (t * k + j) of each sorted position
  float* xp;       // [M, max(D, I)]
  uint8_t* xq;     // [M] x the larger of pairs_bytes and q8_bytes of max(D, I) (q8: 320 bytes per 8 blocks)
  float* gate;     // [M, I]: gate, then the GLU output
  float* up;       // [M, I]
  float* y;        // [M, D]
  int64_t bytes;

  Scratch(void* base, int64_t M, int64_t D, int64_t I) {
    const int64_t K = std::max(D, I);
    const int64_t sizes[6] = {align64(M * 8), align64(M * K * 4), align64(M * std::max(pairs_bytes(K), q8_bytes(K))), align64(M * I * 4),
                              align64(M * I * 4), align64(M * D * 4)};
    char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t{63});
    void* parts[6];
    bytes = 64;
    for (int i = 0; i < 6; ++i) {
      parts[i] = p;
      p += sizes[i];
      bytes += sizes[i];
    }
    order = static_cast<int64_t*>(parts[0]);
    xp = static_cast<float*>(parts[1]);
    xq = static_cast<uint8_t*>(parts[2]);
    gate = static_cast<float*>(parts[3]);
    up = static_cast<float*>(parts[4]);
    y = static_cast<float*>(parts[5]);
  }
};

// How many of the M assignments in ids go to expert e (the rows of its scratch).
int64_t assignments_of(const int64_t* ids, int64_t M, int64_t e) {
  int64_t n = 0;
  for (int64_t a = 0; a < M; ++a) n += ids[a] == e;
  return n;
}

void moe_layer(const float* x, int64_t N, int64_t D, int64_t I, int64_t k, const int64_t* ids, const float* weights,
               const int64_t* table, int64_t E, int64_t only, int glu, float p0, float p1, float* out, void* scratch,
               int threads, int q8) {
  const int64_t M = N * k;
  std::vector<Group> groups;
  Scratch s(scratch, only < 0 ? M : assignments_of(ids, M, only), D, I);
  if (only >= 0) {  // one expert: its assignments alone, in token order (the scratch holds only those rows)
    int64_t n = 0;
    for (int64_t a = 0; a < M; ++a)
      if (ids[a] == only) s.order[n++] = a;
    if (n > 0) groups.push_back(Group{only, 0, n});
  } else {
    std::vector<int64_t> start(E + 1, 0);  // counting sort by expert, stable in token order
    for (int64_t a = 0; a < M; ++a) ++start[ids[a] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < M; ++a) s.order[fill[ids[a]]++] = a;
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) groups.push_back(Group{e, start[e], start[e + 1] - start[e]});
  }
  if (groups.empty()) return;
  const int64_t G = static_cast<int64_t>(groups.size());

  if (q8) {  // each token's q8 record made once, copied to its other assignments (a prefill token has k)
    const int64_t bytes = q8_bytes(D);
    std::vector<int64_t> first(N, -1);
    for (const Group& g : groups)
      for (int64_t a = g.first; a < g.first + g.n; ++a) {
        const int64_t t = s.order[a] / k;
        if (first[t] < 0)
          quantize_row_q8(x + t * D, D / kBlock, reinterpret_cast<GroupQ8*>(s.xq + a * bytes)), first[t] = a;
        else
          std::memcpy(s.xq + a * bytes, s.xq + first[t] * bytes, bytes);
      }
  } else {
    prepare_inputs(groups, D, [&](int64_t a) { return x + (s.order[a] / k) * D; }, s.xp, s.xq, false);
  }
  Phase gate_up{&groups, table, 2, 0, D, I, s.xp, s.xq, {s.gate, s.up}, q8 != 0};
  parallel(phase_rows, &gate_up, G * 2 * I, kChunkBytes / (D / 2 + D / kBlock), threads);

  for (const Group& g : groups) glu_rows(glu, s.gate + g.first * I, s.up + g.first * I, g.n * I, p0, p1);

  prepare_inputs(groups, I, [&](int64_t a) { return s.gate + a * I; }, s.xp, s.xq, q8);
  Phase down{&groups, table, 1, 2, I, D, s.xp, s.xq, {s.y, nullptr}, q8 != 0};
  parallel(phase_rows, &down, G * D, kChunkBytes / (I / 2 + I / kBlock), threads);

  for (const Group& g : groups)
    for (int64_t a = g.first; a < g.first + g.n; ++a) {
      const float w = weights[s.order[a]];
      float* dst = out + (s.order[a] / k) * D;
      const float* y = s.y + a * D;
      for (int64_t d = 0; d < D; ++d) dst[d] += w * y[d];
    }
}

}  // namespace

extern "C" {

// Bytes of scratch mxfp4_moe needs for M assignments: N * k for every expert, or (only >= 0) the
// assignments of that expert alone (a prefill chunk's per-expert call needs its own rows, not the chunk's).
int64_t mxfp4_moe_scratch(int64_t M, int64_t D, int64_t I) { return Scratch(nullptr, M, D, I).bytes; }

// out [N, D] fp32 += the routed experts of N tokens x [N, D] fp32 (see the top of this file).
// ids [N, k] int64 in [0, E), weights [N, k] fp32, table int64 [E, 9]; glu: 0 SwiGLU, 1 gpt-oss, 2 SiTU
// with parameters p0, p1; only: -1 for every expert, else just that one; q8: 1 for q8 activations, 0 exact.
void mxfp4_moe(const float* x, int64_t N, int64_t D, int64_t I, int64_t k, const int64_t* ids, const float* weights,
               const int64_t* table, int64_t E, int64_t only, int glu, float p0, float p1, float* out, void* scratch,
               int threads, int q8) {
  moe_layer(x, N, D, I, k, ids, weights, table, E, only, glu, p0, p1, out, scratch, threads, q8);
}

// The routing alone, the same bits as inside mxfp4_moe_routed (a paging provider's layers route
// with this and run their experts with mxfp4_moe): logits [N, E] (scratch) = rx [N, R] router_w^T
// (+ router_b) by the dense GEMV, then route.h per token into ids_out / weights_out [N, k].
void mxfp4_route(const float* rx, int64_t R, const float* router_w, const float* router_b, const float* correction,
                 int scoring, int renormalize, float scaling, int64_t N, int64_t k, int64_t E, int64_t* ids_out,
                 float* weights_out, float* logits, int threads) {
  localmoe_dense::gemv<float>(rx, N, R, router_w, E, router_b, logits, threads);
  for (int64_t t = 0; t < N; ++t)
    localmoe_route::route_token(logits + t * E, E, k, scoring, correction, renormalize != 0, scaling, ids_out + t * k,
                                weights_out + t * k);
}

// Bytes of scratch mxfp4_moe_routed needs: the logits [N, E], then mxfp4_moe's.
int64_t mxfp4_moe_routed_scratch(int64_t N, int64_t k, int64_t D, int64_t I, int64_t E) {
  return 64 + align64(N * E * 4) + Scratch(nullptr, N * k, D, I).bytes;
}

// The same with the routing too: logits = rx [N, R] router_w^T (+ router_b) with router_w fp32 [E, R]
// (the dense GEMV), each token's k experts and weights by route.h (scoring 0 softmax, 1 sigmoid,
// 2 topk_softmax; correction [E] or null; renormalize; scaling), then the experts on x [N, D]
// (rx = x unless the experts run on a latent projection). The chosen ids and weights are left in
// ids_out / weights_out [N, k].
void mxfp4_moe_routed(const float* rx, int64_t R, const float* router_w, const float* router_b, const float* correction,
                      int scoring, int renormalize, float scaling, const float* x, int64_t N, int64_t D, int64_t I,
                      int64_t k, const int64_t* table, int64_t E, int glu, float p0, float p1, float* out,
                      int64_t* ids_out, float* weights_out, void* scratch, int threads, int q8) {
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  mxfp4_route(rx, R, router_w, router_b, correction, scoring, renormalize, scaling, N, k, E, ids_out, weights_out,
              reinterpret_cast<float*>(base), threads);
  moe_layer(x, N, D, I, k, ids_out, weights_out, table, E, -1, glu, p0, p1, out, base + align64(N * E * 4), threads,
            q8);
}

}  // extern "C"
